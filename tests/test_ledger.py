"""The ledger: only what engines accepted is recorded; once some engine took an operation, every engine it
concerned should have it; a replay is the difference, in an order SGLang takes; weights from a weights update
group cannot be replayed. The control handle's sorting of replies (deferred, failed) on top of it."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from miles_sglang_plugin.serving.control import AsyncDeploymentControl, _Targets
from miles_sglang_plugin.serving.fleet import EngineState, Fleet
from miles_sglang_plugin.serving.ledger import (
    CHECKPOINT,
    ControlState,
    Ledger,
    Record,
    ReplayCall,
    Weights,
    initial_state,
    needs_weights,
    replay_calls,
)
from miles_sglang_plugin.serving.operations import (
    OPERATIONS,
    disk_weights_body,
    disk_weights_effect,
    lora_load_effect,
    lora_unload_effect,
    memory_effect,
    pause_effect,
    weight_version_effect,
)
from miles_sglang_plugin.serving.wire import Answer
from tests.test_reconciler_policy import engine

GEN = {"e1": 0, "e2": 0, "e3": 0}


def ledger(*engines: str) -> Ledger:
    return Ledger({e: initial_state() for e in engines})


def test_an_operation_no_engine_accepted_changes_nothing_for_anyone() -> None:
    book = ledger("e1", "e2")
    record = book.record(
        pause_effect("retract"), sent={"e1": 0}, accepted=[], deferred=["e2"], generations=GEN
    )
    assert (record.recorded, record.deferred) == (False, ("e2",))
    assert book.desired("e2") == book.desired("e1") == initial_state()
    assert book.replay("e2") == []  # a restart of e2 would not hold requests alone


def test_accepted_by_one_it_is_what_every_concerned_engine_should_have() -> None:
    book = ledger("e1", "e2", "e3")
    record = book.record(
        pause_effect("in_place"), sent={"e1": 0, "e2": 0}, accepted=["e1"], deferred=["e3"], generations=GEN
    )
    assert (record.recorded, record.diverged, record.deferred) == (True, ("e2",), ("e3",))
    assert [book.desired(e).paused for e in ("e1", "e2", "e3")] == ["in_place"] * 3
    assert [book.has(e).paused for e in ("e1", "e2", "e3")] == ["in_place", None, None]
    assert [(c.route, dict(c.body)) for c in book.replay("e3")] == [
        ("/pause_generation", {"mode": "in_place"})
    ]


def test_a_refused_lora_load_of_a_name_already_loaded_keeps_the_first_path() -> None:
    book = ledger("e1", "e2")
    both = {"e1": 0, "e2": 0}
    book.record(
        lora_load_effect("math", "/lora/v1", False),
        sent=both,
        accepted=["e1", "e2"],
        deferred=[],
        generations=GEN,
    )
    refused = book.record(
        lora_load_effect("math", "/lora/v2", False), sent=both, accepted=[], deferred=[], generations=GEN
    )
    assert not refused.recorded
    assert book.desired("e1").lora == (("math", "/lora/v1", False),) == book.has("e2").lora
    book.reset("e1")  # restarted: replayed to the first adapter, not the refused one
    assert [(c.route, dict(c.body)) for c in book.replay("e1")] == [
        ("/load_lora_adapter", {"lora_name": "math", "lora_path": "/lora/v1", "pinned": False})
    ]


def test_an_answer_from_a_process_replaced_since_counts_as_deferred() -> None:
    book = ledger("e1", "e2")
    record = book.record(
        pause_effect("abort"),
        sent={"e1": 0, "e2": 0},
        accepted=["e1", "e2"],
        deferred=[],
        generations={"e1": 1, "e2": 0},
    )
    assert (record.recorded, record.deferred, record.diverged) == (True, ("e1",), ())
    assert (book.has("e1").paused, book.desired("e1").paused) == (None, "abort")


def test_a_restarted_engine_is_replayed_its_whole_state_in_sglangs_order() -> None:
    book = ledger("e1")
    body = disk_weights_body("/ckpt/5", weight_version="5", abort_all_requests=True)
    one = {"e1": 0}
    for effect in (
        lora_load_effect("math", "/lora/math", True),
        disk_weights_effect(body),
        memory_effect(["weights", "kv_cache"], released=True),
        pause_effect("retract"),
    ):
        assert book.record(effect, sent=one, accepted=["e1"], deferred=[], generations=one).recorded
    book.reset("e1")
    assert [(c.route, dict(c.body)) for c in book.replay("e1")] == [
        ("/load_lora_adapter", {"lora_name": "math", "lora_path": "/lora/math", "pinned": True}),
        (
            "/update_weights_from_disk",
            {
                "model_path": "/ckpt/5",
                "flush_cache": True,
                "weight_version": "5",
                "abort_all_requests": False,
            },
        ),
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
        ("/pause_generation", {"mode": "retract"}),
    ]


def test_weights_for_an_engine_whose_weights_are_released_are_loaded_between_a_resume_and_a_release() -> None:
    has = ControlState(released=frozenset({"weights"}))
    should = ControlState(
        released=frozenset({"weights"}), weights=Weights.from_disk({"model_path": "/c"}), weight_version=None
    )
    assert [(c.route, dict(c.body)) for c in replay_calls(has, should)] == [
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/update_weights_from_disk", {"model_path": "/c", "abort_all_requests": False}),
        ("/release_memory_occupation", {"tags": ["weights"]}),
    ]


def test_weights_from_a_weights_update_group_cannot_be_replayed() -> None:
    book = ledger("e1", "e2")
    effect = book.distributed_effect("7")
    book.record(effect, sent={"e2": 0}, accepted=["e2"], deferred=["e1"], generations=GEN)
    assert book.needs_weights("e1") and not book.needs_weights("e2")
    assert [(c.route, dict(c.body)) for c in book.replay("e1")] == [
        ("/update_weight_version", {"new_version": "7", "abort_all_requests": False})
    ]
    newer = book.distributed_effect("8")  # the group formed again with e1, the next bucket reaches both
    book.record(newer, sent={"e1": 0, "e2": 0}, accepted=["e1", "e2"], deferred=[], generations=GEN)
    assert not book.needs_weights("e1") and book.replay("e1") == []


def test_weight_group_members_are_who_joined_in_which_generation() -> None:
    book = ledger("e1", "e2")
    book.join_group("g", {"e1": 0, "e2": 3})
    book.reset("e2")  # restarted: out of every group
    assert dict(book.group("g")) == {"e1": 0}
    book.leave_group("g", ["e1"])
    assert dict(book.groups()) == {}


# ---------------------------------------------------------------------------------------------- settle
def _control(*rows):  # type: ignore[no-untyped-def]
    fleet = Fleet(list(rows))
    serving = SimpleNamespace(fleet=fleet, ledger=Ledger({r.id: initial_state() for r in rows}))
    return AsyncDeploymentControl(serving), fleet  # type: ignore[arg-type]


def answer(ok: bool) -> Answer:
    return Answer(200, {"success": True}, None, 0.1) if ok else Answer(None, None, "ReadError: gone", 0.1)


def test_a_local_engine_that_went_down_during_the_call_is_deferred_an_external_one_failed() -> None:
    """Local engines are brought back by the deployment (and replayed); external ones are not restarted
    here, so their failed call is a failure, and the ledger still brings them there when they answer."""
    control, fleet = _control(engine("e1"), engine("e2"), engine("x1", external=True))
    targets = _Targets(tuple(fleet.engines()), (), (), {})
    fleet.transition("e1", EngineState.LOST)
    fleet.transition("x1", EngineState.LOST)
    answers = {"e1": answer(False), "e2": answer(True), "x1": answer(False)}
    result = control._settle(
        OPERATIONS["pause_generation"], targets, answers, {"e1": 0, "e2": 0, "x1": 0}, pause_effect("abort")
    )
    assert result.deferred == ("e1",)
    assert [(r.engine, r.ok) for r in result.replies] == [("e2", True), ("x1", False)]
    assert control._serving.ledger.desired("x1").paused == "abort"


def test_deferred_engines_of_an_operation_no_engine_took_are_failed_with_the_reason() -> None:
    control, fleet = _control(engine("e1", state=EngineState.RESTARTING), engine("e2"))
    targets = _Targets((fleet.engine("e2"),), (), ("e1",), {"e1": "not sent: it is restarting now"})
    result = control._settle(
        OPERATIONS["pause_generation"], targets, {"e2": answer(False)}, {"e2": 0}, pause_effect("abort")
    )
    assert result.deferred == ()
    assert [(r.engine, r.ok) for r in result.replies] == [("e1", False), ("e2", False)]
    assert result.replies[0].error == (
        "not sent: it is restarting now: no engine accepted the operation, so it is not recorded and will not "
        "be replayed into this engine when it is back"
    )
    flush = control._settle(OPERATIONS["flush_cache"], targets, {"e2": answer(True)}, {"e2": 0}, None)
    assert flush.deferred == ("e1",)  # nothing to record: a restarted engine has an empty cache anyway


# ------------------------------------------------------------------------------------- the state's parts
def test_disk_weights_are_kept_as_canonical_json_and_read_back() -> None:
    weights = Weights.from_disk({"model_path": "/c", "flush_cache": True})
    assert weights == Weights("disk", '{"flush_cache": true, "model_path": "/c"}', 0)
    assert weights.disk_body == {"flush_cache": True, "model_path": "/c"}
    assert Weights.from_disk({"b": 1, "a": 2}) == Weights.from_disk({"a": 2, "b": 1})  # any key order
    assert Weights("checkpoint", None, 0) == CHECKPOINT and CHECKPOINT.disk_body is None


def test_adapters_are_kept_sorted_by_name_one_per_name() -> None:
    state = initial_state([("math", "/l/math"), ("code", "/l/code")])
    assert state == ControlState(lora=(("code", "/l/code", False), ("math", "/l/math", False)))
    assert state.lora_names() == ("code", "math")
    state = state.with_lora("art", "/l/art", True).with_lora("math", "/l/math2", True)
    assert state.lora == (("art", "/l/art", True), ("code", "/l/code", False), ("math", "/l/math2", True))
    assert state.without_lora("code").lora == (("art", "/l/art", True), ("math", "/l/math2", True))
    assert state.without_lora("none").lora == state.lora
    assert initial_state() == ControlState() == ControlState(frozenset(), None, (), CHECKPOINT, None)


def test_a_replay_call_describes_itself_with_its_body_sorted() -> None:
    described = ReplayCall("/load_lora_adapter", {"pinned": True, "lora_name": "m"}, lambda s: s).describe()
    assert described == '/load_lora_adapter {"lora_name": "m", "pinned": true}'
    assert ReplayCall("/continue_generation", {}, lambda s: s).describe() == "/continue_generation {}"


def routes(calls: list[ReplayCall]) -> list[tuple[str, dict]]:
    return [(c.route, dict(c.body)) for c in calls]


def reached(has: ControlState, calls: list[ReplayCall]) -> ControlState:
    for c in calls:
        has = c.effect(has)
    return has


def test_memory_is_resumed_first_and_released_after_the_weights() -> None:
    both = frozenset({"weights", "kv_cache"})
    cases = [
        # (has released, should released, the calls)
        (both, frozenset(), [("/resume_memory_occupation", {"tags": ["kv_cache", "weights"]})]),
        (frozenset(), frozenset({"kv_cache"}), [("/release_memory_occupation", {"tags": ["kv_cache"]})]),
        (frozenset({"kv_cache"}), both, [("/release_memory_occupation", {"tags": ["weights"]})]),
        (
            frozenset({"cuda_graph"}),
            frozenset({"weights"}),
            [
                ("/resume_memory_occupation", {"tags": ["cuda_graph"]}),
                ("/release_memory_occupation", {"tags": ["weights"]}),
            ],
        ),
        (both, both, []),
    ]
    for has_released, should_released, expected in cases:
        has, should = ControlState(released=has_released), ControlState(released=should_released)
        calls = replay_calls(has, should)
        assert routes(calls) == expected, (has_released, should_released)
        assert reached(has, calls) == should


def test_a_weight_load_into_released_weights_resumes_and_releases_them_with_the_rest() -> None:
    disk = Weights.from_disk({"model_path": "/c"})
    has = ControlState(released=frozenset({"weights"}))
    should = ControlState(released=frozenset({"weights", "kv_cache"}), weights=disk)
    calls = replay_calls(has, should)
    assert routes(calls) == [
        ("/resume_memory_occupation", {"tags": ["weights"]}),
        ("/update_weights_from_disk", {"model_path": "/c", "abort_all_requests": False}),
        ("/release_memory_occupation", {"tags": ["kv_cache", "weights"]}),
    ]
    assert reached(has, calls) == should
    # Weights that are resident take the load as they are; the KV cache released is brought back.
    has = ControlState(released=frozenset({"kv_cache"}))
    calls = replay_calls(has, ControlState(weights=disk))
    assert routes(calls) == [
        ("/resume_memory_occupation", {"tags": ["kv_cache"]}),
        ("/update_weights_from_disk", {"model_path": "/c", "abort_all_requests": False}),
    ]


def test_adapters_that_differ_are_unloaded_then_what_is_missing_loaded() -> None:
    has = ControlState(lora=(("a", "/a", False), ("b", "/b", False), ("c", "/c", True)))
    should = ControlState(
        lora=(("a", "/a", False), ("b", "/b2", False), ("c", "/c", False), ("d", "/d", True))
    )
    calls = replay_calls(has, should)
    assert routes(calls) == [
        ("/unload_lora_adapter", {"lora_name": "b"}),
        ("/unload_lora_adapter", {"lora_name": "c"}),
        ("/load_lora_adapter", {"lora_name": "b", "lora_path": "/b2", "pinned": False}),
        ("/load_lora_adapter", {"lora_name": "c", "lora_path": "/c", "pinned": False}),
        ("/load_lora_adapter", {"lora_name": "d", "lora_path": "/d", "pinned": True}),
    ]
    assert reached(has, calls) == should
    calls = replay_calls(should, ControlState())
    assert routes(calls) == [("/unload_lora_adapter", {"lora_name": n}) for n in ("a", "b", "c", "d")]
    assert reached(should, calls) == ControlState()


def test_weights_and_their_version_are_replayed_once_each() -> None:
    body = {"model_path": "/ckpt/5", "flush_cache": True, "weight_version": "5"}
    five = Weights.from_disk(body)
    # The load carries its version: no version call after it.
    calls = replay_calls(ControlState(), ControlState(weights=five, weight_version="5"))
    assert routes(calls) == [("/update_weights_from_disk", {**body, "abort_all_requests": False})]
    assert reached(ControlState(), calls) == ControlState(weights=five, weight_version="5")
    # A version set after the load: both, the load first.
    calls = replay_calls(ControlState(), ControlState(weights=five, weight_version="6"))
    assert routes(calls) == [
        ("/update_weights_from_disk", {**body, "abort_all_requests": False}),
        ("/update_weight_version", {"new_version": "6", "abort_all_requests": False}),
    ]
    assert reached(ControlState(), calls).weight_version == "6"
    # The weights are there, the version is not.
    calls = replay_calls(
        ControlState(weights=five, weight_version="5"), ControlState(weights=five, weight_version="7")
    )
    assert routes(calls) == [("/update_weight_version", {"new_version": "7", "abort_all_requests": False})]
    # A load without a version keeps the version the engine has.
    plain = Weights.from_disk({"model_path": "/c"})
    has = ControlState(weight_version="2")
    calls = replay_calls(has, ControlState(weights=plain, weight_version="2"))
    assert routes(calls) == [("/update_weights_from_disk", {"model_path": "/c", "abort_all_requests": False})]
    assert reached(has, calls) == ControlState(weights=plain, weight_version="2")
    # Weights of a weights update group: only their version can be replayed.
    group = ControlState(weights=Weights("distributed", token=3), weight_version="9")
    assert routes(replay_calls(ControlState(), group)) == [
        ("/update_weight_version", {"new_version": "9", "abort_all_requests": False})
    ]
    assert replay_calls(group, group) == []


def test_generation_is_paused_or_continued_last() -> None:
    cases = [
        (None, "retract", [("/pause_generation", {"mode": "retract"})]),
        ("abort", None, [("/continue_generation", {})]),
        ("abort", "in_place", [("/pause_generation", {"mode": "in_place"})]),
        ("retract", "retract", []),
    ]
    for has_paused, should_paused, expected in cases:
        has = ControlState(paused=has_paused, released=frozenset({"kv_cache"}))
        should = ControlState(paused=should_paused)
        calls = replay_calls(has, should)
        assert routes(calls) == [("/resume_memory_occupation", {"tags": ["kv_cache"]}), *expected]
        assert reached(has, calls) == should


def test_only_weights_of_a_group_not_taken_are_needed() -> None:
    group = Weights("distributed", token=2)
    assert needs_weights(ControlState(), ControlState(weights=group))
    assert needs_weights(ControlState(weights=Weights("distributed", token=1)), ControlState(weights=group))
    assert not needs_weights(ControlState(weights=group), ControlState(weights=group))
    assert not needs_weights(ControlState(), ControlState(weights=Weights.from_disk({"model_path": "/c"})))
    assert not needs_weights(ControlState(weights=group), ControlState())


# Operations a trainer sends (their effects, as the control handle records them), for the property below.
_OPERATIONS = st.sampled_from(
    [
        memory_effect(None, released=True),
        memory_effect(["weights"], released=True),
        memory_effect(["kv_cache", "cuda_graph"], released=True),
        memory_effect(None, released=False),
        memory_effect(["weights"], released=False),
        disk_weights_effect(disk_weights_body("/ckpt/1", weight_version="1")),
        disk_weights_effect(disk_weights_body("/ckpt/2")),
        disk_weights_effect(disk_weights_body("/ckpt/3", weight_version="3", load_format="auto")),
        weight_version_effect("v7"),
        pause_effect("retract"),
        pause_effect("abort"),
        pause_effect(None),
        lora_load_effect("math", "/lora/math", False),
        lora_load_effect("math", "/lora/math2", True),
        lora_load_effect("code", "/lora/code", False),
        lora_unload_effect("math"),
        lora_unload_effect("base"),
    ]
)


_ORDER = [
    "/resume_memory_occupation",
    "/unload_lora_adapter",
    "/load_lora_adapter",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/release_memory_occupation",
    "/pause_generation",
    "/continue_generation",
]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_OPERATIONS, st.booleans()), max_size=12), st.booleans())
def test_a_replay_takes_an_engine_from_what_it_took_to_what_it_should_have(
    operations: list, lora_at_start: bool
) -> None:
    """Whatever operations were recorded and whichever of them the engine took (in order, from its command
    line's state), the replay's calls bring it to what it should have, and an engine that has it gets none."""
    start = initial_state([("base", "/lora/base")] if lora_at_start else [])
    has = should = start
    for effect, taken in operations:
        should = effect(should)
        if taken:
            has = effect(has)
    calls = replay_calls(has, should)
    assert reached(has, calls) == should
    assert replay_calls(should, should) == []
    # In SGLang's order: memory back, adapters (unloads first), weights, their version, memory released, pause.
    order = [_ORDER.index(c.route) for c in calls]
    assert order == sorted(order), [c.route for c in calls]


# --------------------------------------------------------------------------------------------- recording
def test_a_record_ignores_accepts_of_engines_it_was_not_sent_to() -> None:
    book = ledger("e1", "e2")
    record = book.record(pause_effect("abort"), sent={"e1": 0}, accepted=["e2"], deferred=[], generations=GEN)
    assert record == Record(recorded=False, diverged=(), deferred=())
    assert book.version == 0 and book.desired("e2") == initial_state()


def test_a_record_lists_deferred_engines_then_replaced_ones_in_order_once_each() -> None:
    book = ledger("e1", "e2", "e3", "e4")
    gens = {"e1": 1, "e2": 1, "e3": 0, "e4": 0}
    record = book.record(
        pause_effect("abort"),
        sent={"e2": 0, "e1": 0, "e3": 0},
        accepted=["e2", "e1", "e3"],
        deferred=["e4", "e2"],
        generations=gens,
    )
    assert record == Record(recorded=True, diverged=(), deferred=("e4", "e2", "e1"))
    assert [book.has(e).paused for e in ("e1", "e2", "e3", "e4")] == [None, None, "abort", None]
    assert [book.desired(e).paused for e in ("e1", "e2", "e3", "e4")] == ["abort"] * 4
    assert book.version == 1
    nobody = book.record(
        pause_effect(None), sent={"e1": 0}, accepted=["e1"], deferred=["e3"], generations=gens
    )
    assert nobody == Record(recorded=False, diverged=(), deferred=("e3", "e1"))
    assert book.version == 1 and book.desired("e3").paused == "abort"


def test_a_record_counts_refusals_of_engines_it_reached_and_skips_engines_removed_meanwhile() -> None:
    book = ledger("e1", "e2", "e3")
    book.drop_engine("e3")
    assert book.version == 1
    record = book.record(
        pause_effect("retract"),
        sent={"e1": 0, "e2": 0, "e3": 0},
        accepted=["e1"],
        deferred=["e2"],
        generations={"e1": 0, "e2": 0, "e3": 0},
    )
    # e2 was sent it but is deferred as well (it went down meanwhile): not a refusal; e3 is gone.
    assert record == Record(recorded=True, diverged=("e3",), deferred=("e2",))
    assert (book.desired("e1").paused, book.desired("e2").paused, book.has("e2").paused) == (
        "retract",
    ) * 2 + (None,)
    assert book.version == 2


def test_every_change_of_the_ledger_bumps_its_version_once() -> None:
    book = ledger("e1", "e2")
    steps = [
        lambda: book.accepted("e1", pause_effect("abort")),
        lambda: book.reset("e1"),
        lambda: book.add_engine("e3", initial_state(), ControlState(paused="abort")),
        lambda: book.join_group("g", {"e1": 0}),
        lambda: book.leave_group("g", ["e1"]),
        lambda: book.drop_engine("e3"),
    ]
    for n, step in enumerate(steps, start=1):
        step()
        assert book.version == n
    book.leave_group("never-formed", ["e1"])  # no such group: nothing changes
    book.distributed_effect("1")  # a token only: nothing recorded yet
    assert book.version == len(steps)


def test_each_bucket_of_distributed_weights_is_a_token_of_its_own() -> None:
    book = ledger("e1")
    first, second = book.distributed_effect("3"), book.distributed_effect(None)
    state = first(ControlState(weight_version="1"))
    assert state == ControlState(weights=Weights("distributed", token=1), weight_version="3")
    assert second(state) == ControlState(weights=Weights("distributed", token=2), weight_version="3")


def test_an_added_engine_has_its_command_lines_state_and_should_have_its_models() -> None:
    book = ledger("e1")
    should = ControlState(paused="retract", lora=(("m", "/m", False),))
    book.add_engine("e2", initial_state([("m", "/m")]), should)
    assert routes(book.replay("e2")) == [("/pause_generation", {"mode": "retract"})]
    book.accepted("e2", pause_effect("retract"))
    book.reset("e2")  # restarted: back to its command line's state, not to nothing
    assert book.has("e2") == initial_state([("m", "/m")])
    book.drop_engine("e2")
    assert book.replay("e1") == []


def test_groups_are_views_and_a_group_ends_with_its_last_member() -> None:
    book = ledger("e1", "e2")
    book.join_group("g", {"e1": 0, "e2": 1})
    book.join_group("h", {"e2": 1})
    book.join_group("g", {"e1": 2})  # formed again: replaces the first forming
    assert {name: dict(m) for name, m in book.groups().items()} == {"g": {"e1": 2}, "h": {"e2": 1}}
    book.leave_group("h", ["e2", "e9"])
    assert set(book.groups()) == {"g"} and dict(book.group("h")) == {}
