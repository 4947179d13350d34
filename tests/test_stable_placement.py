"""Stable placement (``planning/stable.py``): the plan a running deployment converges to keeps every engine of
the same model, group and shape where it is; only what changed moves. Every slot below is worked out by hand
(rollout-only runs: slots from 0; 8 GPUs per node unless said otherwise)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.resolution import resolve_deployment
from miles_sglang_plugin.planning.stable import stabilize
from tests.conftest import group, model, spec

R = TrainerInputs(hf_checkpoint="/ckpt", debug_rollout_only=True, num_gpus_per_node=8)


def pd(prefill: int, decode: int, prefill_gpe: int = 1, decode_gpe: int = 1):  # type: ignore[no-untyped-def]
    return resolve_deployment(
        spec(
            model(
                "actor", group("prefill", prefill, gpe=prefill_gpe), group("decode", decode, gpe=decode_gpe)
            )
        ),
        R,
    )


def slots(plan, engine: str) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    return next(e.gpu_slots for e in plan.engines if e.id == engine)


def test_moving_two_gpus_from_prefill_to_decode_keeps_every_engine_that_stays():
    """Prefill 4 (slots 0-3) + decode 4 (slots 4-7), all TP 1. Prefill 2, decode 6: prefill.0-1 keep 0-1,
    decode.0-3 keep 4-7, prefill.2-3 stop, and the new decode.4-5 take the freed slots 2-3 (a fresh
    resolution would move every decode engine: decode.0 to slot 2)."""
    running, fresh = pd(4, 4), pd(2, 6)
    plan, diff = stabilize(running, fresh)
    assert diff.kept == (
        "actor.prefill.0",
        "actor.prefill.1",
        "actor.decode.0",
        "actor.decode.1",
        "actor.decode.2",
        "actor.decode.3",
    )
    assert diff.started == ("actor.decode.4", "actor.decode.5")
    assert diff.stopped == ("actor.prefill.2", "actor.prefill.3")
    assert [slots(plan, f"actor.decode.{i}") for i in range(6)] == [(4,), (5,), (6,), (7,), (2,), (3,)]
    assert slots(fresh, "actor.decode.0") == (2,)
    assert dict(diff.unlike_fresh)["actor.decode.0"] == (2,)
    # Ranks: the kept engines keep theirs (prefill 0, 1; decode 4..7), the new ones come after all in use.
    assert [e.rank for e in plan.engines] == [0, 1, 4, 5, 6, 7, 8, 9]
    assert diff.lines()[6] == "started   actor.decode.4   - -> node 0 GPUs 2"


def test_a_shape_change_replaces_just_that_groups_engines():
    """Decode TP 1 -> TP 2 over the same 4 GPUs (slots 4-7): decode.0 and .1 are replaced (new slots 4-5 and
    6-7: the old decode engines' slots are free once they are gone), decode.2-3 stop; prefill is kept."""
    plan, diff = stabilize(pd(4, 4), pd(4, 4, decode_gpe=2))
    assert diff.kept == tuple(f"actor.prefill.{i}" for i in range(4))
    assert diff.replaced == ("actor.decode.0", "actor.decode.1")
    assert diff.stopped == ("actor.decode.2", "actor.decode.3")
    assert [slots(plan, f"actor.decode.{i}") for i in range(2)] == [(4, 5), (6, 7)]
    assert [c.reason for c in diff.changes if c.change == "replaced"] == ["1 -> 2 GPUs per engine"] * 2


def test_an_added_model_takes_the_free_gpus_and_a_removed_one_gives_them_back():
    actor = model("actor", group("regular", 4, gpe=2))
    running = resolve_deployment(spec(actor), R)
    grown = resolve_deployment(spec(actor, model("reward", group("regular", 2, gpe=1), path="/rm")), R)
    plan, diff = stabilize(running, grown)
    assert (diff.kept, diff.started, diff.models_added) == (
        ("actor.regular.0", "actor.regular.1"),
        ("reward.regular.0", "reward.regular.1"),
        ("reward",),
    )
    assert [slots(plan, e) for e in ("reward.regular.0", "reward.regular.1")] == [(4,), (5,)]
    _back, diff = stabilize(plan, running)
    assert (diff.kept, diff.stopped, diff.models_removed) == (
        ("actor.regular.0", "actor.regular.1"),
        ("reward.regular.0", "reward.regular.1"),
        ("reward",),
    )


def test_engines_never_cross_a_node_and_wide_ones_take_whole_nodes():
    """4 GPUs per node. Running: a.0, a.1 (1 GPU each, slots 0, 1), b.0 (2 GPUs, slots 2-3). New: a shrinks to
    1, placeholders pad (1 GPU) and pad2 (2), c (2 GPUs) and w (8 GPUs, two whole nodes) are added; fresh slots
    a 0, pad 1, b 2-3, c 4-5, pad2 6-7, w 8-15. Kept: a.0 at 0, b.0 at 2-3; in group order the rest takes the
    lowest free slots: pad slot 1 (a.1's), c 4-5, pad2 6-7, w nodes 2 and 3."""
    four = TrainerInputs(hf_checkpoint="/ckpt", debug_rollout_only=True, num_gpus_per_node=4)
    b = model("b", group("regular", 2, gpe=2), path="/b")
    running = resolve_deployment(spec(model("a", group("regular", 2, gpe=1)), b), four)
    fresh = resolve_deployment(
        spec(
            model("a", group("regular", 1, gpe=1), group("placeholder", 1, name="pad")),
            b,
            model("c", group("regular", 2, gpe=2), group("placeholder", 2, name="pad2"), path="/c"),
            model("w", group("regular", 8, gpe=8), path="/w"),
        ),
        four,
    )
    assert slots(fresh, "b.regular.0") == (2, 3)  # after a's pad
    plan, diff = stabilize(running, fresh)
    assert diff.kept == ("a.regular.0", "b.regular.0") and diff.stopped == ("a.regular.1",)
    assert plan.model("a").group("pad").gpu_offset == 1  # a.1's slot
    assert slots(plan, "c.regular.0") == (4, 5)
    assert plan.model("c").group("pad2").gpu_offset == 6
    assert slots(plan, "w.regular.0") == tuple(range(8, 16))
    assert [p.node for p in next(e for e in plan.engines if e.id == "w.regular.0").processes] == [2, 3]


def test_free_runs_stay_on_one_node_and_wide_engines_take_whole_nodes():
    from miles_sglang_plugin.planning.stable import _Slots

    free = _Slots(0, 16, per_node=4)
    free.take([0, 1, 2, 5])
    assert free.first_fit(1) == (3,)
    assert free.first_fit(2) == (6, 7)  # 3-4 would cross into node 1, 4-5 holds slot 5
    assert free.first_fit(8) == tuple(range(8, 16))  # nodes 2 and 3, whole
    free.take([9])
    assert free.first_fit(8) is None and free.first_fit(3) == (12, 13, 14)


def test_with_no_room_next_to_the_kept_engines_it_is_packed_as_a_fresh_resolution():
    """Prefill 2 (slots 0, 1) + decode 1 of TP 2 (slots 2-3). Prefill 1, decode 2 of TP 2: prefill.1's slot 1
    and slot 4 are free but not next to each other, so decode.1 finds no room: the plan packs as the fresh
    resolution (prefill 0, decode 1-2, 3-4): prefill.0 is kept, decode.0 moves (replaced), decode.1 starts."""
    plan, diff = stabilize(pd(2, 2, decode_gpe=2), pd(1, 4, decode_gpe=2))
    assert diff.packed_afresh
    assert (diff.kept, diff.replaced, diff.started, diff.stopped) == (
        ("actor.prefill.0",),
        ("actor.decode.0",),
        ("actor.decode.1",),
        ("actor.prefill.1",),
    )
    assert [slots(plan, f"actor.decode.{i}") for i in range(2)] == [(1, 2), (3, 4)]


def test_a_kept_placeholder_block_stays_and_a_resized_one_moves():
    running = resolve_deployment(spec(model("actor", group("regular", 2, gpe=1), group("placeholder", 2))), R)
    plan, _ = stabilize(running, running)
    assert plan.model("actor").group("placeholder").gpu_offset == 2
    fresh = resolve_deployment(spec(model("actor", group("regular", 4, gpe=1), group("placeholder", 2))), R)
    plan, diff = stabilize(running, fresh)
    # The block 2-3 is kept; the two new engines take 4-5 (fresh: engines 0-3, placeholder at 4).
    assert plan.model("actor").group("placeholder").gpu_offset == 2
    assert diff.started == ("actor.regular.2", "actor.regular.3")
    assert [slots(plan, f"actor.regular.{i}") for i in (2, 3)] == [(4,), (5,)]


def test_no_room_left_is_refused_naming_the_engine():
    """Shrinking the deployment's GPUs so that a kept engine sits outside the new plan: it is moved; when
    nothing is free for it, the change is refused before anything happens."""
    running = resolve_deployment(spec(model("actor", group("regular", 4, gpe=2))), R)
    fresh = resolve_deployment(spec(model("actor", group("regular", 2, gpe=2))), R)
    _plan, diff = stabilize(running, fresh)
    assert (diff.kept, diff.stopped) == (("actor.regular.0",), ("actor.regular.1",))
    with pytest.raises(DeploymentConfigError, match="num_gpus_per_node: changes from 8 to 4"):
        stabilize(
            running,
            resolve_deployment(
                spec(model("actor", group("regular", 4, gpe=2))),
                TrainerInputs(hf_checkpoint="/ckpt", debug_rollout_only=True, num_gpus_per_node=4),
            ),
        )


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([1, 2, 4]),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.sampled_from([1, 2]),
)
def test_a_converged_plan_never_shares_a_gpu_and_keeps_what_it_can(
    gpe_old, p_old, p_new, d_old, d_new, d_gpe
):
    """Any resize of a PD model: the converged plan's engines are disjoint and within its GPUs, every engine
    of an unchanged shape whose index remains is kept at its old slots, and the group sizes are the fresh
    resolution's."""
    try:
        running = pd(p_old * gpe_old, d_old * 2, prefill_gpe=gpe_old, decode_gpe=2)
        fresh = pd(p_new * gpe_old, d_new * d_gpe, prefill_gpe=gpe_old, decode_gpe=d_gpe)
    except DeploymentConfigError:  # a deployment resolution refuses (an engine across a node)
        assume(False)
    plan, diff = stabilize(running, fresh)
    taken = [s for e in plan.engines for s in e.gpu_slots]
    assert len(taken) == len(set(taken)) and all(0 <= s < fresh.total_gpus for s in taken)
    old = {e.id: e.gpu_slots for e in running.engines}
    for engine in plan.engines:
        if engine.id in diff.kept:
            assert engine.gpu_slots == old[engine.id]
    assert [(g.name, len(g.engines)) for _m, g in plan.groups()] == [
        (g.name, len(g.engines)) for _m, g in fresh.groups()
    ]
    if d_gpe == 2 and not diff.packed_afresh:  # an unchanged shape whose GPUs are still the plan's stays
        inside = {e for e, s in old.items() if e.startswith("actor.decode.") and max(s) < fresh.total_gpus}
        assert set(diff.kept) >= {f"actor.decode.{i}" for i in range(min(d_old, d_new))} & inside
