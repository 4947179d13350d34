"""Property-based tests of resolution: random deployments, Miles' invariants, and clean errors only."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.config.deployment_spec import DeploymentSpec, GroupSpec, ModelSpec, WorkerType
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.planning.plan import DeploymentPlan
from miles_sglang_plugin.planning.resolution import resolve_deployment

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def trainers(draw, gpn: int | None = None, total: int | None = None) -> TrainerInputs:
    """Random trainer inputs; colocated with a deployment of ``total`` GPUs, the actor is that large (Miles sizes
    a colocated rollout as the actor). Some have a PPO critic (which shares the actor's GPUs)."""
    gpn = gpn or draw(st.sampled_from([1, 2, 4, 8]))
    colocate = draw(st.booleans())
    actor_nodes = total // gpn if colocate and total else draw(st.integers(1, 3))
    return TrainerInputs(
        hf_checkpoint="/ckpt/actor",
        num_gpus_per_node=gpn,
        actor_num_nodes=actor_nodes,
        actor_num_gpus_per_node=gpn,
        colocate=colocate,
        offload_rollout=draw(st.sampled_from([None, True, False])),
        rollout_num_gpus_per_engine=draw(st.sampled_from([1, 2, 4])),
        debug_rollout_only=draw(st.booleans()) if not colocate else False,
        use_critic=draw(st.booleans()),
        critic_num_nodes=draw(st.sampled_from([None, 0, 1, 2])),
        critic_num_gpus_per_node=draw(st.sampled_from([None, 0, 4])),
    )


@st.composite
def aligned_deployments(draw, gpn: int) -> DeploymentSpec:
    """Deployments that are valid by construction: every group covers whole nodes, engines tile them."""
    gpes = [d for d in (1, 2, 4, 8) if gpn % d == 0] + [gpn * 2, gpn * 4]
    models = []
    for i in range(draw(st.integers(1, 4))):
        pd = draw(st.booleans())
        types = ["prefill", "decode"] if pd else ["regular"] * draw(st.integers(1, 2))
        if draw(st.booleans()):
            types.insert(draw(st.integers(0, len(types))), "placeholder")
        groups = []
        for j, wt in enumerate(types):
            gpe = draw(st.sampled_from(gpes))
            nodes = draw(st.integers(1, 3))
            num = max(nodes * gpn, gpe) if gpe <= gpn else gpe * draw(st.integers(1, 2))
            overrides = {"enable_memory_saver": True} if draw(st.integers(0, 5)) == 0 else {}
            groups.append(
                GroupSpec(
                    name=f"{wt}{j}",
                    worker_type=wt,
                    num_gpus=num,
                    num_gpus_per_engine=gpe,
                    overrides=overrides,
                )
            )
        models.append(
            ModelSpec(
                name=f"m{i}",
                groups=tuple(groups),
                model_path=None if i == 0 else f"/ckpt/m{i}",
                update_weights=None,
            )
        )
    return DeploymentSpec(models=tuple(models), source="hypothesis")


def check_invariants(plan: DeploymentPlan, spec: DeploymentSpec, t: TrainerInputs) -> None:
    gpn = t.num_gpus_per_node
    ro = plan.rollout_offset
    # Offsets are contiguous, in deployment order, starting at 0.
    expected_offset = 0
    for (_, g), sg in zip(plan.groups(), (g for m in spec.models for g in m.groups), strict=True):
        assert g.gpu_offset == expected_offset
        assert g.num_gpus == sg.num_gpus
        expected_offset += g.num_gpus
    assert plan.total_gpus == expected_offset == sum(g.num_gpus for m in spec.models for g in m.groups)
    # Every GPU slot of the deployment is used exactly once (engines or placeholders).
    owners = []
    for _, g in plan.groups():
        if g.worker_type is WorkerType.placeholder:
            owners += list(range(ro + g.gpu_offset, ro + g.gpu_offset + g.num_gpus))
            assert g.engines == ()
        else:
            assert len(g.engines) == g.num_gpus // g.num_gpus_per_engine
            for e in g.engines:
                owners += list(e.gpu_slots)
                assert len(e.gpu_slots) == g.num_gpus_per_engine
                assert e.nnodes == max(1, g.num_gpus_per_engine // gpn)
                for p in e.processes:
                    assert len({s // gpn for s in p.gpu_slots}) == 1  # a process sits on one node
                    assert p.node == p.gpu_slots[0] // gpn
                    assert p.local_gpu_ids == tuple(s % gpn for s in p.gpu_slots)
    assert sorted(owners) == list(range(ro, ro + plan.total_gpus))
    check_ranks(plan, gpn)
    # needs_offload: with offload on, a group takes part iff its first GPU slot is one Megatron trains on.
    megatron = megatron_slots(t)
    first_slot = rollout_start(t)
    for (_, g), sg in zip(plan.groups(), (g for m in spec.models for g in m.groups), strict=True):
        if g.engines:
            assert g.engines[0].gpu_slots[0] == first_slot
        assert g.needs_offload == (t.offload_rollout and first_slot in megatron), (
            g.key,
            first_slot,
            megatron,
        )
        # The memory saver: off for groups that need no offload (a user override wins), else left alone.
        user = sg.overrides.get("enable_memory_saver")
        if t.offload_rollout and not g.needs_offload:
            assert g.overrides["enable_memory_saver"] is (user if user is not None else False)
        else:
            assert g.overrides.get("enable_memory_saver") is user
        first_slot += sg.num_gpus
    assert sum(m.update_weights for m in plan.models) <= 1


def check_ranks(plan: DeploymentPlan, gpn: int) -> None:
    """Miles' ranks (rollout_server.py ``engine_offset``): each group advances the cursor by
    num_gpus // min(gpus per engine, GPUs per node), placeholders included; an engine's processes (one per
    node) take consecutive ranks from its first."""
    cursor = 0
    for _, g in plan.groups():
        for i, e in enumerate(g.engines):
            first = cursor + i * e.nnodes
            assert e.rank == first
            assert [p.rank for p in e.processes] == list(range(first, first + e.nnodes))
        cursor += g.num_gpus // min(g.num_gpus_per_engine, gpn)


def megatron_slots(t: TrainerInputs) -> set[int]:
    """The GPU slots Megatron trains on, enumerated from the trainer's arguments (Miles' placement): the actor's
    nodes from slot 0, none when only rollout runs. A PPO critic shares the actor's slots (Miles dec268f70)."""
    if t.debug_rollout_only:
        return set()
    return set(range(t.actor_num_nodes * t.actor_num_gpus_per_node))


def rollout_start(t: TrainerInputs) -> int:
    """The first rollout slot: 0 when colocated with training or training is off, else right after the actor."""
    return 0 if t.colocate or t.debug_rollout_only else t.actor_num_nodes * t.actor_num_gpus_per_node


@SETTINGS
@given(data=st.data())
def test_valid_random_deployments_satisfy_miles_invariants(data):
    gpn = data.draw(st.sampled_from([1, 2, 4, 8]))
    spec = data.draw(aligned_deployments(gpn))
    given = data.draw(trainers(gpn, total=sum(g.num_gpus for m in spec.models for g in m.groups)))
    plan = resolve_deployment(spec, given)
    t = plan.trainer
    # Miles' post-processing: offload on when colocated unless given, off when only rollout runs.
    expected_offload = given.offload_rollout if given.offload_rollout is not None else given.colocate
    assert t.offload_rollout is (expected_offload and not given.debug_rollout_only)
    check_invariants(plan, spec, t)
    assert plan.rollout_num_gpus == plan.total_gpus


@SETTINGS
@given(data=st.data())
def test_any_layout_resolves_or_fails_cleanly(data):
    """Unaligned sizes: a plan that keeps every invariant, or one clean error naming keys."""
    t = data.draw(trainers())
    models = []
    for i in range(data.draw(st.integers(1, 3))):
        types = data.draw(
            st.lists(st.sampled_from(["regular", "prefill", "decode", "placeholder"]), min_size=1, max_size=3)
        )
        groups = tuple(
            GroupSpec(
                name=f"g{j}",
                worker_type=wt,
                num_gpus=data.draw(st.integers(1, 20)),
                num_gpus_per_engine=data.draw(st.one_of(st.none(), st.integers(1, 16))),
            )
            for j, wt in enumerate(types)
        )
        models.append(ModelSpec(name=f"m{i}", groups=groups, model_path=f"/p{i}", update_weights=False))
    spec = DeploymentSpec(models=tuple(models))
    try:
        plan = resolve_deployment(spec, t)
    except DeploymentConfigError as exc:
        assert exc.problems and all(p.key and p.message for p in exc.problems)
        assert str(exc).count("\n  - ") == len(exc.problems)
    else:
        check_invariants(plan, spec, plan.trainer)


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 40),
    st.floats(allow_nan=True),
    st.text(max_size=6),
    st.lists(st.integers(), max_size=2),
)


@SETTINGS
@given(data=st.data())
def test_garbage_input_gives_a_clear_error_never_an_internal_exception(data):
    groups = tuple(
        GroupSpec(
            name=data.draw(st.sampled_from(["a", "b", "a"])),
            worker_type=data.draw(
                st.one_of(st.sampled_from(["regular", "prefill", "decode", "placeholder"]), junk)
            ),
            num_gpus=data.draw(junk),
            num_gpus_per_engine=data.draw(junk),
            overrides=data.draw(
                st.dictionaries(
                    st.sampled_from(
                        ["host", "tp_size", "pp_size", "dp_size", "mem-fraction-static", "model_path"]
                    ),
                    junk,
                    max_size=3,
                )
            ),
        )
        for _ in range(data.draw(st.integers(0, 3)))
    )
    spec = DeploymentSpec(
        models=(
            ModelSpec(
                name=data.draw(
                    st.one_of(st.sampled_from(["actor", "eval", "bad name", ""]), st.text(max_size=4))
                ),
                groups=groups,
                model_path=data.draw(st.one_of(st.none(), st.just("/x"))),
                update_weights=data.draw(st.one_of(st.none(), st.booleans(), junk)),
                num_gpus_per_engine=data.draw(junk),
            ),
        )
    )
    t = TrainerInputs(
        hf_checkpoint="/x",
        rollout_num_gpus=data.draw(st.one_of(st.none(), st.integers(0, 30))),
        num_gpus_per_node=data.draw(st.sampled_from([1, 8])),
        eval_num_gpus=data.draw(st.sampled_from([0, 2])),
        colocate=True,
    )
    try:
        resolve_deployment(
            spec, t, server_arg_fields=data.draw(st.one_of(st.none(), st.just({"tp_size", "model_path"})))
        )
    except DeploymentConfigError as exc:
        assert exc.problems
