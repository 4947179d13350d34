"""Rolling weight updates (issue 35): the waves' sizes worked out by hand, then the real control handle and a
real reconciler on the fakes of :mod:`tests.reconciler_fakes`, in virtual time.

The deployment is four regular engines of one GPU each with the stand-in deployment's settings (see
``tests/test_reconciler_fakes.py``): a fake engine answers ``/health_generate`` 0.5 s after its start; the
drain of an updating engine asks its ``/metrics`` every 2 x RESTART_POLL_S (0.1 s)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles_sglang_plugin.serving.control import AsyncDeploymentControl
from miles_sglang_plugin.serving.discovery import rl_workers
from miles_sglang_plugin.serving.fleet import EngineState
from miles_sglang_plugin.serving.results import OperationResult
from miles_sglang_plugin.serving.rolling import GroupProgress, check_fraction, next_wave, wave_size
from tests.reconciler_fakes import Harness
from tests.test_reconciler_fakes import prepared_of, start_up

S = EngineState
FOUR = ("sglang.actor.num_gpus_per_engine=1", "sglang.actor.regular.num_gpus=4")
E = [f"actor.regular.{i}" for i in range(4)]
UPDATE = "POST /update_weights_from_disk"


# ------------------------------------------------------------------------------------------------ the waves
def test_a_wave_keeps_the_ceiling_of_the_fraction_serving() -> None:
    assert wave_size(4, 4, 0.75) == 1  # 3 of 4 keep serving
    assert wave_size(4, 4, 0.5) == 2
    assert wave_size(8, 8, 0.6) == 3  # ceil(4.8) = 5 keep serving
    assert wave_size(10, 10, 0.7) == 3  # 0.7 * 10 is 7.000000000000001 in floats: still 7 keep serving
    assert wave_size(4, 4, 0.0) == 4
    assert wave_size(1, 1, 0.75) == 1  # a group of one: the update goes on
    assert wave_size(4, 2, 0.75) == 1  # two lost meanwhile: one at a time


def test_each_group_rolls_on_its_own_and_engines_that_do_not_serve_go_together() -> None:
    groups = {
        "actor.prefill": GroupProgress(("p0", "p1"), frozenset({"p0", "p1"}), ("p0", "p1")),
        "actor.decode": GroupProgress(
            ("d0", "d1", "d2", "d3"), frozenset({"d0", "d1", "d2", "d3"}), ("d0", "d1", "d2", "d3")
        ),
        "ref.regular": GroupProgress(("r0", "r1"), frozenset(), ("r0", "r1")),  # both lost
    }
    assert next_wave(groups, 0.5) == ("p0", "d0", "d1", "r0", "r1")
    later = {
        "actor.decode": GroupProgress(("d0", "d1", "d2", "d3"), frozenset({"d0", "d1", "d2"}), ("d2", "d3")),
    }
    # d3 is lost: of the 3 serving, 2 must keep serving: one goes (the serving one), d3 waits its turn
    assert next_wave(later, 0.5) == ("d2",)
    assert next_wave({"a.b": GroupProgress(("x",), frozenset({"x"}), ())}, 0.5) == ()


@given(n=st.integers(min_value=1, max_value=16), percent=st.integers(min_value=0, max_value=100))
def test_the_waves_of_a_group_update_every_engine_once_and_keep_the_fraction_where_they_can(
    n: int, percent: int
) -> None:
    engines = tuple(f"e{i}" for i in range(n))
    fraction = percent / 100
    keep = math.ceil(Fraction(percent, 100) * n)  # exact: the decimal the user typed
    waiting: list[str] = list(engines)
    seen: list[str] = []
    while waiting:
        wave = next_wave({"g": GroupProgress(engines, frozenset(engines), tuple(waiting))}, fraction)
        assert wave and set(wave) <= set(waiting)
        assert n - len(wave) >= min(keep, n - 1)  # the fraction kept, except where only one at a time is left
        seen += wave
        waiting = [e for e in waiting if e not in wave]
    assert sorted(seen) == sorted(engines)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), "0.5", True])
def test_a_fraction_outside_zero_to_one_is_refused_with_its_name(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"min_serving_fraction must be a number >= 0 and <= 1, got"):
        check_fraction(bad)


# ------------------------------------------------------------------------------------- in virtual time
@pytest.fixture
def four(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Harness]:
    prepared = prepared_of(*FOUR)
    harness = Harness(prepared, prepared.settings, tmp_path)
    harness.patch_router_processes(monkeypatch)
    start_up(harness)
    yield harness
    harness.close()
    harness.check_no_surprises()


def control_of(h: Harness) -> AsyncDeploymentControl:
    serving = SimpleNamespace(
        fleet=h.fleet,
        ledger=h.ledger,
        reconciler=h.reconciler,
        serving_loop=h.serving,
        pool=h.pool,
        settings=h.settings,
        refusal=lambda when: None,
    )
    return AsyncDeploymentControl(serving)  # type: ignore[arg-type]


def roll(
    h: Harness, *, fraction: float, drain_s: float = 30.0, during: Callable[[], None] | None = None, **kw: Any
) -> tuple[OperationResult, list[int]]:
    """Run a rolling update of step 7 to its end; the router's worker count after each registration and
    removal on the way (from the trace, in order)."""
    since = h.trace.mark
    task = h.loop.create_task(
        control_of(h).update_weights_from_disk(
            "/ckpt/step7",
            weight_version="7",
            rolling=True,
            min_serving_fraction=fraction,
            drain_timeout_s=drain_s,
            **kw,
        )
    )

    def done() -> bool:
        if during is not None:
            during()
        return task.done()

    h.run_until(done, within=600, step=0.001)
    listed = [len(E)]
    for entry in h.trace.entries[since:]:
        if entry.what in ("registered", "deregistered"):
            listed.append(listed[-1] + (1 if entry.what == "registered" else -1))
    return task.result(), listed


def entries(h: Harness, engine: str) -> list[str]:
    return [e.what for e in h.trace.of(engine) if e.what not in ("GET /health", "GET /metrics")]


def test_two_waves_of_two_keep_half_the_engines_serving_and_each_engine_loads_once_out_of_its_router(
    four: Harness,
) -> None:
    h = four
    result, listed = roll(h, fraction=0.5)
    assert result.ok and result.accepted == tuple(E)
    assert min(listed) == 2 and listed[-1] == 4  # never fewer than ceil(0.5 * 4) in the router
    for engine in E:
        # out of its router, then the weights (what was left aborted: the client carries it on), then back in
        assert entries(h, engine)[-3:] == ["deregistered", UPDATE, "registered"]
        update = h.trace.first(engine, UPDATE)
        assert update.body["abort_all_requests"] is True and update.body["weight_version"] == "7"
        assert h.ledger.has(engine).weight_version == "7" == h.ledger.desired(engine).weight_version
        assert h.fleet.engine(engine).state is S.SERVING
    # the second wave leaves only once the first serves again; the first wave's two leave together
    out = {e: h.trace.first(e, "deregistered").seq for e in E}
    back = {e: h.trace.first(e, "registered", since=out[e]).seq for e in E}
    assert out[E[2]] > max(back[E[0]], back[E[1]]) and out[E[1]] < back[E[0]]
    kinds = [(k, s) for _t, k, s, _m, _d in h.events.timeline if k in ("engine_updating", "engine_updated")]
    assert kinds == [
        ("engine_updating", E[0]),
        ("engine_updating", E[1]),
        ("engine_updated", E[0]),
        ("engine_updated", E[1]),
        ("engine_updating", E[2]),
        ("engine_updating", E[3]),
        ("engine_updated", E[2]),
        ("engine_updated", E[3]),
    ]
    assert "weight version 7" in h.events.one("engine_updated", E[3])[1]


def test_three_quarters_go_one_at_a_time(four: Harness) -> None:
    h = four
    result, listed = roll(h, fraction=0.75)
    assert result.ok and min(listed) == 3
    order = [s for _t, k, s, _m, _d in h.events.timeline if k == "engine_updating"]
    assert order == E


def test_an_engine_finishes_its_requests_before_it_loads(four: Harness) -> None:
    """E0 has 2, then 1, then 0 requests at its drain polls (0.1 s apart): the update goes out after the third
    poll, and not before."""
    h = four
    name = h.fleet.engine(E[0]).launches[0].name
    h.backend.running_requests[name] = [2, 1, 0]
    result, _ = roll(h, fraction=0.75)
    assert result.ok
    after_out = [e for e in h.trace.of(E[0]) if e.seq > h.trace.first(E[0], "deregistered").seq]
    whats = [e.what for e in after_out if e.what != "GET /health"]
    assert whats[:4] == ["GET /metrics", "GET /metrics", "GET /metrics", UPDATE]
    polls = [e.t for e in after_out if e.what == "GET /metrics"]
    assert [round(b - a, 2) for a, b in itertools.pairwise(polls)] == [0.1, 0.1]


def test_an_engine_that_never_finishes_is_updated_once_its_drain_time_is_over(four: Harness) -> None:
    h = four
    name = h.fleet.engine(E[0]).launches[0].name
    h.backend.running_requests[name] = [5]
    result, _ = roll(h, fraction=0.75, drain_s=3.0)
    assert result.ok
    out = h.trace.first(E[0], "deregistered")
    update = h.trace.first(E[0], UPDATE)
    assert update.t - out.t == pytest.approx(3.0, abs=0.25)  # its drain time, then aborted by the update


def test_an_engine_lost_while_it_drains_gets_the_weights_by_replay_and_the_update_goes_on(
    four: Harness,
) -> None:
    h = four
    name = h.fleet.engine(E[0]).launches[0].name
    h.backend.running_requests[name] = [3]  # it would drain for its whole 30 s

    killed: list[bool] = []

    def kill_when_updating() -> None:
        if not killed and h.fleet.engine(E[0]).state is S.UPDATING:
            h.backend.kill(name)
            killed.append(True)
            h.backend.running_requests[name] = [0]

    result, _ = roll(h, fraction=0.75, during=kill_when_updating)
    assert killed
    assert result.deferred == (E[0],) and result.accepted == tuple(E[1:])
    h.run_until(lambda: h.fleet.engine(E[0]).state is S.SERVING, within=30)
    replay = [e for e in h.trace.of(E[0]) if e.what == UPDATE]
    assert len(replay) == 1 and replay[0].body["abort_all_requests"] is False  # by replay, never aborting
    assert h.ledger.has(E[0]).weight_version == "7"
    assert h.fleet.engine(E[0]).update_hold is None


def test_a_wave_no_engine_accepts_ends_the_update_and_the_others_keep_their_weights(
    four: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = four
    route = h.pool._engine_route

    def refusing(process: Any, method: str, path: str) -> tuple[int, Any]:
        if path == "/update_weights_from_disk":
            return 400, {"success": False, "message": "no such checkpoint"}
        return route(process, method, path)

    monkeypatch.setattr(h.pool, "_engine_route", refusing)
    result, _ = roll(h, fraction=0.75, check=False)
    assert [r.engine for r in result.failed] == E
    assert "no such checkpoint" in (result.failed[0].error or "")
    assert all("rolling update stopped" in (r.error or "") for r in result.failed[1:]), result.describe()
    assert [s for _t, k, s, _m, _d in h.events.timeline if k == "engine_updating"] == [E[0]]
    assert [h.ledger.desired(e).weight_version for e in E] == ["default"] * 4  # the command line's, kept
    h.run_until(lambda: len(h.router().listed()) == 4, within=10)  # E0 serves again, on its old weights


def test_the_plain_update_is_unchanged_one_call_each_at_once_without_leaving_the_router(
    four: Harness,
) -> None:
    h = four
    task = h.loop.create_task(control_of(h).update_weights_from_disk("/ckpt/step7", weight_version="7"))
    h.run_until(task.done, within=30)
    assert task.result().ok
    for engine in E:
        assert "deregistered" not in entries(h, engine)[-2:]
        assert h.trace.first(engine, UPDATE).body["abort_all_requests"] is False


def test_updating_engines_are_sent_control_operations_and_are_listed_as_draining(four: Harness) -> None:
    h = four
    row = dataclasses.replace(h.fleet.engine(E[0]), state=S.UPDATING)
    assert row.state.up  # a control operation still reaches an engine that updates
    listing = rl_workers([row.info()])
    assert listing["workers"][0]["health"] == "draining"
    assert listing["workers"][0]["state"] == "updating"
