"""Changing a running deployment while it serves, with stand-in engines and the real router (both gateways:
the SMG tier runs this file again): the reproductions of issue 36, each a deployment that changed the wrong way
before. A router killed under load that never became ready again, a control operation out during an ``apply``
that failed or missed the added engines, an ``apply`` that timed out and left a plan that no longer described
the fleet, an added engine that could not start and took the deployment down, a change of router mode that
was accepted, two live engines on one GPU, and port claims kept by every ``apply``.

Every deployment here is checked to leave nothing behind (``leak_check``)."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.errors import ApplyTimeoutError
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import (
    STANDIN_MODULE,
    LeakTracker,
    children_of,
    compose,
    generate_body,
    random_port_base,
)
from tests.router_helpers import router_workers

FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.1",
    "sglang_deploy.supervision.kill_grace_s=0.5",
    "sglang_deploy.router.policy=round_robin",
]
PD_4_4 = ["sglang=pd", "sglang.actor.num_gpus_per_engine=1", "sglang.actor.prefill.num_gpus=4",
          "sglang.actor.decode.num_gpus=4"]  # fmt: skip


def stats(url: str) -> dict:  # type: ignore[type-arg]
    return httpx.get(url + "/stand_in/stats", timeout=10).json()  # type: ignore[no-any-return]


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 120.0) -> None:
    """A generous bound: what is waited for happens, or the test has found the bug."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.05)


class Load:
    """``threads`` clients posting /generate through the model's router without pause; each outcome kept."""

    def __init__(self, d: Deployment, threads: int, model: str = "actor") -> None:
        self.url = d.registry.get_model_url(model)
        self.outcomes: list[int | str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(threads)]

    def _client(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.is_set():
                try:
                    self.outcomes.append(http.post(self.url, json=generate_body()).status_code)
                except httpx.HTTPError as exc:
                    self.outcomes.append(type(exc).__name__)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        wait_until(lambda: len(self.outcomes) >= 4, "the clients' first answers")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def gpu_holders() -> dict[str, list[int]]:
    """GPU -> the live stand-in engine processes of this test process whose environment holds it."""
    holders: dict[str, list[int]] = {}
    for pid in children_of(os.getpid(), (STANDIN_MODULE,)):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        for entry in environ:
            if entry.startswith(b"CUDA_VISIBLE_DEVICES="):
                for gpu in entry.split(b"=", 1)[1].decode().split(","):
                    holders.setdefault(gpu, []).append(pid)
    return holders


class GpuSampler:
    """Samples every engine process's GPUs (from its own environment) while a change runs: no sample may show
    two live engine processes on one GPU."""

    def __init__(self) -> None:
        self.samples = 0
        self.overlaps: list[dict[str, list[int]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            shared = {gpu: pids for gpu, pids in gpu_holders().items() if len(pids) > 1}
            # a process that exited between the two reads is not on the GPU: read once more to be sure
            if shared and {g: p for g, p in gpu_holders().items() if len(p) > 1}:
                self.overlaps.append(shared)
            self.samples += 1
            time.sleep(0.01)

    def __enter__(self) -> GpuSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


# ------------------------------------------------------------------------------------------------ routers
def test_a_router_killed_under_saturating_load_is_ready_again_every_time(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """PD 2 + 2, four clients sending without pause; the router SIGKILLed three times: each time it is back
    (``router_recovered``, ``ready``) and serves, and the deployment is ``serving`` again. Before: the poll out
    when it died wedged it ``starting`` for good in 3 of 5 runs."""
    cfg = compose("sglang=pd", "sglang.actor.num_gpus_per_engine=1", "sglang.actor.prefill.num_gpus=2",
                  "sglang.actor.decode.num_gpus=2", "sglang_deploy.supervision.router_max_restarts=5",
                  *FAST, port_base=random_port_base())  # fmt: skip
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d, Load(d, threads=4) as load:
        for kill in range(1, 4):
            router = d.fleet.router("actor")
            assert router is not None
            os.kill(router.process.pid, signal.SIGKILL)  # type: ignore[arg-type]
            wait_until(
                lambda kill=kill: sum(e.kind == "router_recovered" for e in d.events()) == kill,
                f"router_recovered number {kill}",
            )
            wait_until(lambda: d.state().status == "serving", "the deployment serving again")
            served = len(load.outcomes)
            wait_until(lambda served=served: load.outcomes[served:].count(200) >= 4, "answers after it")
        assert [r.state for r in d.state().routers] == ["ready"]
        assert d.fleet.router("actor").restarts == 3  # type: ignore[union-attr]


# --------------------------------------------------------------------------------------- control and apply
def test_an_operation_out_when_an_apply_starts_reaches_the_engines_it_adds(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """A weight update (each engine takes 1 s to answer) is out when two GPUs move from prefill to decode: it
    returns OK for the six engines it was sent to that stay, the two removed ones are left out of it (no
    ``KeyError``), and the two added decode engines serve with weight version v1, as every engine does."""
    cfg = compose(*PD_4_4, *FAST, "sglang_deploy.standin.control_latency_s=1.0", port_base=random_port_base())
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        update = d.control.background.update_weights_from_disk("/ckpt/step1", weight_version="v1")
        time.sleep(0.3)  # the calls are out
        result = d.move_gpus("actor", "prefill", "decode", 2)
        assert result.started == ("actor.decode.4", "actor.decode.5")
        assert result.stopped == ("actor.prefill.2", "actor.prefill.3")
        outcome = update.result(timeout=120)
        assert outcome.ok
        assert sorted(r.engine for r in outcome.replies if r.ok) == sorted(
            ["actor.prefill.0", "actor.prefill.1", *(f"actor.decode.{i}" for i in range(4))]
        )
        wait_until(lambda: d.state().status == "serving", "every engine serving")
        assert {e.id: stats(e.url)["weight_version"] for e in d.engines()} == {
            **{f"actor.prefill.{i}": "v1" for i in range(2)},
            **{f"actor.decode.{i}": "v1" for i in range(6)},
        }
        assert d.control.weight_versions() == {e.id: "v1" for e in d.engines()}


def test_an_operation_started_while_engines_are_added_reaches_them_before_they_serve(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """2 -> 4 regular engines; generation is paused while the two new ones start: they are paused too before
    they serve (by the ledger: they get it by replay), and continue with the others."""
    cfg = compose("sglang.actor.num_gpus_per_engine=1", "sglang.actor.regular.num_gpus=2", *FAST,
                  port_base=random_port_base())  # fmt: skip
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        done = threading.Event()
        resized: list[object] = []

        def resize() -> None:
            resized.append(d.resize("actor", "regular", 4))
            done.set()

        thread = threading.Thread(target=resize)
        thread.start()
        wait_until(lambda: len(d.engines()) == 4, "the added rows")
        paused = d.control.pause_generation("in_place")
        assert paused.ok
        thread.join(timeout=120)
        assert done.is_set()
        assert {e.id: stats(e.url)["paused"] for e in d.engines()} == {
            f"actor.regular.{i}": "in_place" for i in range(4)
        }
        assert d.control.continue_generation().engines == tuple(f"actor.regular.{i}" for i in range(4))


# -------------------------------------------------------------------------------------------- transactions
def test_an_apply_that_times_out_goes_on_and_the_plan_describes_the_fleet(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """``resize(4)`` with a 0.05 s timeout raises ApplyTimeoutError naming the engines still starting; the
    change goes on (the fleet becomes 4 engines), ``deployment.plan`` says 4 from the moment it was submitted,
    and a later ``resize(2)`` works from the fleet: 2 kept, 2 stopped (before: ``8 kept`` of engines that did
    not exist, then IllegalTransitionError)."""
    cfg = compose("sglang.actor.num_gpus_per_engine=1", "sglang.actor.regular.num_gpus=2", *FAST,
                  port_base=random_port_base())  # fmt: skip
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        with pytest.raises(
            ApplyTimeoutError, match=r"it goes on: actor\.regular\.2 \w+, actor\.regular\.3 \w+"
        ):
            d.resize("actor", "regular", 4, timeout_s=0.05)
        assert [e.id for e in d.plan.engines] == [f"actor.regular.{i}" for i in range(4)]
        wait_until(lambda: d.state().status == "serving", "the change to converge on its own")
        assert [e.id for e in d.engines()] == [e.id for e in d.plan.engines]
        result = d.resize("actor", "regular", 2)
        assert (result.kept, result.stopped, result.started) == (
            ("actor.regular.0", "actor.regular.1"),
            ("actor.regular.2", "actor.regular.3"),
            (),
        )
        assert [e.id for e in d.engines()] == ["actor.regular.0", "actor.regular.1"]


def test_a_change_between_pd_and_regular_serving_replaces_the_router(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """PD 2 + 2 -> the same model as 4 regular engines, and back: the router is replaced in the other mode on
    the same address once the old engines are gone, the new engines register with it and serve (before: the
    change was accepted, the PD router never listed a regular worker as healthy, every regular engine was
    restarted for ever)."""
    base = random_port_base()
    pd = ["sglang=pd", "sglang.actor.num_gpus_per_engine=1", "sglang.actor.prefill.num_gpus=2",
          "sglang.actor.decode.num_gpus=2", *FAST]  # fmt: skip
    regular = ["sglang=default", "sglang.actor.num_gpus_per_engine=1", "rollout_num_gpus=4", *FAST]
    with launch_from_config(compose(*pd, port_base=base), log_dir=tmp_path / "logs") as d:
        url = d.registry.get_model_url("actor")
        result = d.apply(compose(*regular, port_base=base))
        assert result.stopped == ("actor.prefill.0", "actor.prefill.1", "actor.decode.0", "actor.decode.1")
        assert result.started == tuple(f"actor.regular.{i}" for i in range(4))
        assert result.routers_replaced == ("actor",)
        assert d.registry.get_model_url("actor") == url
        listed = router_workers(d.registry["actor"].base_url)
        assert sorted((w["url"], w["worker_type"], w["is_healthy"]) for w in listed) == sorted(
            (e.url, "regular", True) for e in d.engines()
        )
        assert httpx.post(url, json=generate_body(), timeout=30).status_code == 200
        assert [e.kind for e in d.events() if e.kind == "router_replaced"] == ["router_replaced"]
        back = d.apply(compose(*pd, port_base=base))
        assert back.routers_replaced == ("actor",)
        types = sorted(w["worker_type"] for w in router_workers(d.registry["actor"].base_url))
        assert types == ["decode", "decode", "prefill", "prefill"]
        assert httpx.post(url, json=generate_body(), timeout=30).status_code == 200
        assert d.state().status == "serving"
        assert [r.restarts for r in d.state().routers] == [0]


def test_an_added_engine_that_cannot_start_is_given_up_alone(tmp_path: Path, leak_check: LeakTracker) -> None:
    """2 -> 3 engines where the new one exits at start (``max_restarts=1``): it is given up (``failed``), the
    change reports it, the two engines that served keep serving every request; applying again without the
    fault starts it. Before: the whole deployment was stopped, or apply raised an empty CancelledError."""
    base = random_port_base()
    common = ["sglang.actor.num_gpus_per_engine=1", "sglang_deploy.supervision.max_restarts=1", *FAST]
    with launch_from_config(compose(*common, "sglang.actor.regular.num_gpus=2", port_base=base),
                            log_dir=tmp_path / "logs") as d, Load(d, threads=2) as load:  # fmt: skip
        faulty = compose(*common, "sglang.actor.regular.num_gpus=3",
                         "sglang_deploy.standin.fail_at_start=[actor.regular.2]", port_base=base)  # fmt: skip
        result = d.apply(faulty)
        assert result.given_up == ("actor.regular.2",)
        assert result.kept == ("actor.regular.0", "actor.regular.1")
        assert {e.id: e.state for e in d.engines()} == {
            "actor.regular.0": "serving",
            "actor.regular.1": "serving",
            "actor.regular.2": "failed",
        }
        assert [e.subject for e in d.events() if e.kind == "engine_given_up"] == ["actor.regular.2"]
        assert d.failure is None
        served = len(load.outcomes)
        wait_until(lambda: load.outcomes[served:].count(200) >= 6, "requests served after the change")
        assert set(load.outcomes) == {200}
        again = d.apply(compose(*common, "sglang.actor.regular.num_gpus=3", port_base=base))
        assert again.replaced == ("actor.regular.2",)
        assert {e.id: e.state for e in d.engines()} == {f"actor.regular.{i}": "serving" for i in range(3)}


# ------------------------------------------------------------------------------------- GPUs and descriptors
def test_no_two_live_engines_ever_share_a_gpu_through_applies_and_kills(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """PD 4 + 4; two GPUs move to decode while the prefill engine on GPU 3, which the change removes, is
    SIGKILLed 0.1 s in; then back, while a kept engine is killed and restarted. The GPUs of every live engine
    process, read from its own environment every ~10 ms, never show one GPU twice. Before: the killed
    engine was restarted on GPU 3 next to the added decode.5."""
    cfg = compose(*PD_4_4, *FAST, port_base=random_port_base())
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d, GpuSampler() as sampler:
        victim = d.fleet.engine("actor.prefill.3").processes[0].pid  # type: ignore[attr-defined]
        threading.Timer(0.1, _kill, (victim,)).start()
        result = d.move_gpus("actor", "prefill", "decode", 2)
        assert result.stopped == ("actor.prefill.2", "actor.prefill.3")
        kept = d.fleet.engine("actor.decode.0").processes[0].pid  # type: ignore[attr-defined]
        os.kill(kept, signal.SIGKILL)
        back = d.move_gpus("actor", "decode", "prefill", 2)
        assert back.started == ("actor.prefill.2", "actor.prefill.3")
        wait_until(lambda: d.state().status == "serving", "every engine serving")
        assert sorted(gpu_holders()) == [str(g) for g in range(8)]
        assert all(len(pids) == 1 for pids in gpu_holders().values())
    assert sampler.samples > 20
    assert sampler.overlaps == []


def test_port_claims_and_descriptors_stay_flat_across_applies(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Six applies 2 -> 4 -> 2 ...: this process's open descriptors after them are within 5 % (and a handful)
    of before them. Before: each removed engine kept the claims of 30 of its 32 ports (two descriptors each),
    about +120 descriptors per shrink."""
    cfg = compose("sglang.actor.num_gpus_per_engine=1", "sglang.actor.regular.num_gpus=2", *FAST,
                  port_base=random_port_base())  # fmt: skip
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        d.resize("actor", "regular", 4)
        d.resize("actor", "regular", 2)
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(3):
            d.resize("actor", "regular", 4)
            d.resize("actor", "regular", 2)
        after = len(os.listdir("/proc/self/fd"))
        assert after - before <= max(8, before * 0.05), (before, after)


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # stopped by the change already
        os.kill(pid, signal.SIGKILL)
