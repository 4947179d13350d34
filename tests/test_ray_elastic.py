"""Where the engine processes a change of a running deployment adds go on the ray backend
(:func:`~miles_sglang_plugin.backends.ray_placement.place_added`, pure: no Ray). The same on the cluster:
``tests/test_ray_backend.py``, "changing a running deployment"."""

from __future__ import annotations

from miles_sglang_plugin.backends.ray_placement import BundlePlan, HeldGpus, ProcessPlacement, place_added


def _process(engine: str, node: int, gpus: tuple[int, ...]) -> ProcessPlacement:
    return ProcessPlacement(engine, 0, engine, node, tuple(node * 8 + g for g in gpus), gpus)


def test_added_processes_go_onto_the_actor_whose_bundle_holds_their_gpus() -> None:
    """Node 0's actor holds local GPUs 0-3 (engines 0-1 at TP 2, engine 1 removed): an engine added at 2,3 goes
    onto it; one at 4,5 and one at 6,7 get one new actor for node 0 (a bundle of 4,5,6,7); one on node 1 gets
    its own. One actor per process: each a bundle of its own. An engine at 3,4 would split the bundle."""
    held = [HeldGpus("node 0", 0, (0, 1, 2, 3))]
    added = [_process("a.2", 0, (2, 3)), _process("a.3", 0, (4, 5)), _process("a.4", 0, (6, 7)),
             _process("a.5", 1, (0, 1))]  # fmt: skip
    per_node = place_added(added, held, per_node=True, in_trainer_group=False)
    assert per_node.onto == {("a.2", 0): "node 0"} and per_node.problems == ()
    assert per_node.new == (
        BundlePlan(0, (4, 5, 6, 7), (("a.3", 0), ("a.4", 0))),
        BundlePlan(1, (0, 1), (("a.5", 0),)),
    )
    per_process = place_added(
        added[1:3], [HeldGpus("a.1", 0, (2, 3))], per_node=False, in_trainer_group=False
    )
    assert per_process.new == (BundlePlan(0, (4, 5), (("a.3", 0),)), BundlePlan(0, (6, 7), (("a.4", 0),)))
    split = place_added([_process("a.6", 0, (3, 4))], held, per_node=True, in_trainer_group=False)
    assert (split.onto, split.new) == ({}, ())
    assert split.problems == (
        "a.6: its local GPUs 3,4 of node 0 are in part (GPUs 3) held by node 0, whose bundle cannot be split",
    )


def test_added_processes_in_the_trainers_group_join_their_nodes_actor() -> None:
    held = [HeldGpus("node 1", 1)]
    added = [_process("a.2", 1, (4, 5)), _process("a.3", 2, (0, 1))]
    per_node = place_added(added, held, per_node=True, in_trainer_group=True)
    assert per_node.onto == {("a.2", 0): "node 1"}
    assert per_node.new == (BundlePlan(2, (0, 1), (("a.3", 0),)),)
    per_process = place_added(added, held, per_node=False, in_trainer_group=True)
    assert per_process.onto == {} and [b.processes for b in per_process.new] == [(("a.2", 0),), (("a.3", 0),)]
