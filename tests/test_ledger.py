"""The ledger: only what engines accepted is recorded; once some engine took an operation, every engine it
concerned should have it; a replay is the difference, in an order SGLang takes; weights from a weights update
group cannot be replayed. The control handle's sorting of replies (deferred, failed) on top of it."""

from __future__ import annotations

from types import SimpleNamespace

from miles_sglang_plugin.serving.control import AsyncDeploymentControl, _Targets
from miles_sglang_plugin.serving.fleet import EngineState, Fleet
from miles_sglang_plugin.serving.ledger import ControlState, Ledger, Weights, initial_state, replay_calls
from miles_sglang_plugin.serving.operations import (
    OPERATIONS,
    disk_weights_body,
    disk_weights_effect,
    lora_load_effect,
    memory_effect,
    pause_effect,
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
