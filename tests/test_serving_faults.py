"""The serving core against the faults that broke it (stand-in engines, real sglang-routers, and misbehaving
external engines of the test's own): state changes an engine missed while away, operations no engine took,
refused LoRA loads, engines that drip or answer garbage, a router restarted under load, bad arguments.

Every deployment here is checked to leave nothing behind (``leak_check``)."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import math
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.backends.base import LaunchError
from miles_sglang_plugin.serving.deployment import Deployment
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, generate_body
from tests.misbehaving_engine import MisbehavingEngine
from tests.test_external_engines_live import judge
from tests.test_standin import Proc, spawn, start_standin, wait_http  # noqa: F401  (the spawn fixture)

FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.1",
    "sglang_deploy.supervision.kill_grace_s=0.5",
    "sglang_deploy.router.policy=round_robin",
]


def stats(url: str) -> dict:
    return httpx.get(url + "/stand_in/stats", timeout=10).json()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Poll ``condition`` (a generous bound: what is waited for happens at once or never)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


def pid_of(d: Deployment, engine: str) -> int:
    return d.fleet.engine(engine).processes[0].pid  # type: ignore[attr-defined]


def six_requests(d: Deployment, model: str = "actor") -> list[int]:
    """Six generations through the model's router at once (round_robin: three per engine of two)."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=15) as client:
            url = d.registry.get_model_url(model)
            answers = await asyncio.gather(*(client.post(url, json=generate_body()) for _ in range(6)))
            return [a.status_code for a in answers]

    return asyncio.run(run())


def test_an_external_engine_that_was_away_comes_back_with_what_changed_meanwhile(
    tmp_path: Path, spawn: Callable[..., Proc], leak_check: LeakTracker
) -> None:
    """While judge.external.1 does not answer, the trainer pauses the judge model and judge.external.0 takes
    it: when .1 answers again it is paused too before it serves (before: only registered again, never
    paused)."""
    outside = [start_standin(spawn), start_standin(spawn)]
    for engine in outside:
        wait_http(engine)
    with launch_from_config(compose(*judge(*(e.url for e in outside))), log_dir=tmp_path / "logs") as d:
        since = len(d.events())
        os.kill(outside[1].popen.pid, signal.SIGSTOP)
        try:
            d.wait_for_event("external_engine_lost", subject="judge.external.1", since=since, timeout_s=120)
            result = d.control.pause_generation("in_place", model="judge")
            assert (result.engines, result.deferred) == (("judge.external.0",), ("judge.external.1",))
        finally:
            os.kill(outside[1].popen.pid, signal.SIGCONT)
        d.wait_for_event("external_engine_back", subject="judge.external.1", since=since, timeout_s=120)
        assert [stats(e.url)["paused"] for e in outside] == ["in_place", "in_place"]
        d.control.continue_generation(model="judge")
        assert [stats(e.url)["paused"] for e in outside] == [None, None]


def test_a_pause_that_reached_no_engine_is_not_replayed(tmp_path: Path, leak_check: LeakTracker) -> None:
    """Both engines are killed; a pause while they are down reaches neither: it fails, naming each, and is not
    recorded, so the restarted engines serve (before: replayed into the next restarted engine, which then
    held its share of the requests alone: 3 of 6 hung)."""
    cfg = compose("sglang.actor.regular.num_gpus=2", *FAST, "sglang_deploy.standin.start_delay_s=3")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:  # a restart takes 3 s: time to pause
        since = len(d.events())
        for engine in ("actor.regular.0", "actor.regular.1"):
            os.kill(pid_of(d, engine), signal.SIGKILL)
        for engine in ("actor.regular.0", "actor.regular.1"):
            d.wait_for_event("engine_lost", subject=engine, since=since, timeout_s=120)
        result = d.control.pause_generation("in_place", timeout_s=5, check=False)
        assert [r.ok for r in result.replies] == [False, False] and result.deferred == ()
        assert all(
            "no engine accepted the operation, so it is not recorded" in (r.error or "")
            for r in result.replies
        )
        for engine in ("actor.regular.0", "actor.regular.1"):
            d.wait_for_event("engine_recovered", subject=engine, since=since, timeout_s=120)
        assert [d.ledger.desired(e.id).paused for e in d.engines()] == [None, None]
        assert [stats(e.url)["paused"] for e in d.engines()] == [None, None]
        assert six_requests(d) == [200] * 6


def test_a_lora_load_the_engines_refused_is_not_replayed(tmp_path: Path, leak_check: LeakTracker) -> None:
    """A second load of an adapter name already loaded is refused by every engine: the record keeps the first
    adapter, and a restarted engine gets that one (before: the refused path overwrote the record, and the
    restarted engine diverged from the others)."""
    cfg = compose("sglang.actor.regular.num_gpus=2", *FAST, "sglang_deploy.lora.enabled=true")
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        d.control.load_lora_adapter("math", "/lora/math-v1")
        refused = d.control.load_lora_adapter("math", "/lora/math-v2", check=False)
        assert [r.ok for r in refused.replies] == [False, False]
        assert "already loaded" in (refused.replies[0].error or "")
        since = len(d.events())
        os.kill(pid_of(d, "actor.regular.0"), signal.SIGKILL)
        d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=120)
        assert [stats(e.url)["lora_adapters"] for e in d.engines()] == [{"math": "/lora/math-v1"}] * 2
        assert d.state().status == "serving"


def test_a_dripping_external_engine_fails_the_start_cleanly_within_its_deadline(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """An external engine whose answers drip without end: every poll ends at its own deadline (the launcher
    closes its connection), so the launch fails at startup_timeout_s naming it (before: still running,
    silent, after 40 s)."""
    with MisbehavingEngine("drip") as drip:
        cfg = compose(*judge(drip.url), startup_timeout_s=5)
        started = time.monotonic()
        with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
            pytest.fail("the launch should have failed")
        took = time.monotonic() - started
        assert drip.drips_started >= 1
        wait_until(lambda: drip.drips_open == 0, "the launcher to close every dripping answer")
    assert f"external engine judge.external.0 never answered /health_generate at {drip.url}" in str(exc.value)
    assert took >= 5  # the start-up deadline (a drip never ends: the launch ended by that deadline)


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("garbage_info", "/server_info reports tp_size 'abc', not a whole number in 1..65536"),
        ("endless_info", "/server_info: its answer is larger than 1048576 bytes"),
    ],
)
def test_an_external_engine_with_a_bad_server_info_fails_the_start_with_one_clear_line(
    tmp_path: Path, leak_check: LeakTracker, mode: str, message: str
) -> None:
    """``{"tp_size": "abc"}`` was a ValueError traceback; an endless answer grew the launcher to 2 GB in 12 s.
    Both are one line naming the engine, and the answer read stops at its size cap."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with MisbehavingEngine(mode) as bad:
        cfg = compose(*judge(bad.url), startup_timeout_s=20)
        with pytest.raises(LaunchError) as exc, launch_from_config(cfg, log_dir=tmp_path / "logs"):
            pytest.fail("the launch should have failed")
    assert str(exc.value) == f"external engine judge.external.0 ({bad.url}): {message}"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024  # KiB: under 200 MB


def test_a_dripping_health_endpoint_does_not_delay_noticing_a_local_engines_death(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """After start-up the external engine drips its /health: its polls end at their own deadline, in parallel,
    and the local engine's exit is told by the operating system. The local engine is noticed lost (and
    healed) before the dripping one is given up, and stopping does not wait for the drip (before: the local
    engine's death was noticed after 30 s, and stop() took 30 s). The drip never ends: a stop that waited for
    it would never return, and the launcher closes every dripping answer it was given."""
    with MisbehavingEngine("healthy") as outside:
        cfg = compose(*judge(outside.url), *FAST, "sglang_deploy.supervision.failure_threshold=4")
        with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
            since = len(d.events())
            outside.mode = "drip_health"
            os.kill(pid_of(d, "actor.regular.0"), signal.SIGKILL)
            lost = d.wait_for_event("engine_lost", subject="actor.regular.0", since=since, timeout_s=120)
            away = d.wait_for_event(
                "external_engine_lost", subject="judge.external.0", since=since, timeout_s=20
            )
            assert lost.monotonic < away.monotonic
            assert "no answer to /health within 0.5 s (4 polls in a row)" in away.message
            d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=120)
        assert outside.drips_started >= 4  # the polls that lost it
        wait_until(lambda: outside.drips_open == 0, "the launcher to close every dripping answer")


def test_a_restarted_router_serves_from_its_first_answer(
    tmp_path: Path, leak_check: LeakTracker, test_gateway: str
) -> None:
    """Requests keep coming while the router is killed: those that find no router fail to connect, and once
    it answers again none gets a 503 for want of workers (it starts with the serving engines). SMG 1.13 answers
    404 ``model_not_found`` for the moment it takes to register the workers it was given (sglang-router 0.3.2
    holds such a request until they are in)."""
    with launch_from_config(
        compose("sglang.actor.regular.num_gpus=2", *FAST), log_dir=tmp_path / "logs"
    ) as d:
        url = d.registry.get_model_url("actor")
        statuses: list[tuple[float, int | str]] = []
        stop = threading.Event()

        def client() -> None:
            with httpx.Client(timeout=10) as http:
                while not stop.is_set():
                    try:
                        statuses.append((time.monotonic(), http.post(url, json=generate_body()).status_code))
                    except httpx.TransportError as exc:
                        statuses.append((time.monotonic(), type(exc).__name__))
                        time.sleep(0.005)

        threads = [threading.Thread(target=client) for _ in range(4)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.5)
            since = len(d.events())
            os.kill(d.fleet.routers()[0].process.pid, signal.SIGKILL)
            recovered = d.wait_for_event(
                "router_recovered", subject="router.actor", since=since, timeout_s=120
            )
            time.sleep(1.0)
        finally:
            stop.set()
            for thread in threads:
                thread.join(timeout=30)
    answered = [status for _, status in statuses if isinstance(status, int)]
    allowed = {200, 404} if test_gateway == "smg" else {200}
    assert 503 not in answered and set(answered) <= allowed, sorted(set(answered))
    assert any(t > recovered.monotonic and s == 200 for t, s in statuses)


def test_bad_control_arguments_are_refused_before_any_call(tmp_path: Path, leak_check: LeakTracker) -> None:
    colocated = ["debug_rollout_only=false", "colocate=true", "actor_num_gpus_per_node=1"]  # offloaded
    cfg = compose("sglang.actor.regular.num_gpus=1", *colocated)
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        for bad in (0, -1, math.nan, math.inf, "1"):
            with pytest.raises(ValueError, match="timeout_s must be"):
                d.control.pause_generation(timeout_s=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="new_version must be a string"):
            d.control.update_weight_version(None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="memory tags must be some of weights, kv_cache, cuda_graph"):
            d.control.offload(["weights", "kvcache"])
        assert stats(d.engines()[0].url)["control_calls"] == []  # nothing was sent
        d.control.offload("weights")  # one tag, not six letters
        assert stats(d.engines()[0].url)["control_calls"][-1] == [
            "/release_memory_occupation",
            {"tags": ["weights"]},
        ]
