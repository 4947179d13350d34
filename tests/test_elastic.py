"""Changing a running deployment (``Deployment.apply``, ``resize``, ``move_gpus``) with stand-in engines and
the real sglang-router: what stays keeps its processes, ports and GPUs; what goes is taken out of its router,
finishes its requests and stops; what comes serves with the deployment's control state; a change that does
not fit is refused whole, and nothing changes.

Every deployment here is checked to leave nothing behind (``leak_check``)."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.serving.deployment import Deployment
from miles_sglang_plugin.serving.elastic import check_settings
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose, generate_body, process_alive, random_port_base
from tests.router_helpers import router_workers

FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.kill_grace_s=0.5",
]


def cfg_of(*overrides: str, port_base: int):  # type: ignore[no-untyped-def]
    return compose(*overrides, port_base=port_base)


def pids(d: Deployment) -> dict[str, int]:
    return {row.id: row.processes[0].pid for row in d.fleet.engines() if row.processes}  # type: ignore[attr-defined]


def stats(url: str) -> dict:
    return httpx.get(url + "/stand_in/stats", timeout=10).json()


def listed(d: Deployment, model: str = "actor") -> list[str]:
    return sorted(w["url"] for w in router_workers(d.registry[model].base_url) if w.get("is_healthy"))


def test_moving_gpus_from_prefill_to_decode_keeps_every_engine_that_stays(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Prefill 4 (GPUs 0-3) + decode 4 (GPUs 4-7), TP 1. Two GPUs move to decode: prefill.0-1 and decode.0-3
    keep their processes, ports and GPUs; prefill.2-3 stop; decode.4-5 start on GPUs 2 and 3."""
    base = random_port_base()
    overrides = ["sglang=pd", "sglang.actor.num_gpus_per_engine=1", *FAST]
    cfg = cfg_of(
        *overrides, "sglang.actor.prefill.num_gpus=4", "sglang.actor.decode.num_gpus=4", port_base=base
    )
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        before = pids(d)
        urls = {e.id: e.url for e in d.engines()}
        result = d.move_gpus("actor", "prefill", "decode", 2)
        assert result.kept == (
            "actor.prefill.0",
            "actor.prefill.1",
            "actor.decode.0",
            "actor.decode.1",
            "actor.decode.2",
            "actor.decode.3",
        )
        assert (result.started, result.stopped) == (
            ("actor.decode.4", "actor.decode.5"),
            ("actor.prefill.2", "actor.prefill.3"),
        )
        after = pids(d)
        assert {e: after[e] for e in result.kept} == {e: before[e] for e in result.kept}
        assert {e.id: e.url for e in d.engines() if e.id in result.kept} == {e: urls[e] for e in result.kept}
        assert {e.id: e.gpus for e in d.engines()} == {
            "actor.prefill.0": "0",
            "actor.prefill.1": "1",
            "actor.decode.0": "4",
            "actor.decode.1": "5",
            "actor.decode.2": "6",
            "actor.decode.3": "7",
            "actor.decode.4": "2",
            "actor.decode.5": "3",
        }
        assert [stats(e.url)["cuda_visible_devices"] for e in d.engines()[-2:]] == ["2", "3"]
        assert not any(process_alive(before[e]) for e in result.stopped)
        assert listed(d) == sorted(e.url for e in d.engines())
        assert d.state().status == "serving" and [e.id for e in d.engines()] == [e.id for e in d.plan.engines]
        kinds = sorted((e.kind, e.subject) for e in d.events())
        assert kinds == [
            ("engine_added", "actor.decode.4"),
            ("engine_added", "actor.decode.5"),
            ("engine_removed", "actor.prefill.2"),
            ("engine_removed", "actor.prefill.3"),
        ]


def test_new_engines_serve_with_the_deployments_control_state(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Weights 7 from disk, a LoRA adapter, generation paused: an engine added by a resize has all of it
    before it serves; the engines that stay were not called again."""
    base = random_port_base()
    overrides = ["sglang.actor.num_gpus_per_engine=1", "sglang_deploy.lora.enabled=true", *FAST]
    with launch_from_config(
        cfg_of(*overrides, "sglang.actor.regular.num_gpus=1", port_base=base), log_dir=tmp_path / "logs"
    ) as d:
        d.control.update_weights_from_disk("/ckpt/step7", weight_version="7")
        d.control.load_lora_adapter("math", "/lora/math")
        d.control.pause_generation("in_place")
        calls_before = len(stats(d.engines()[0].url)["control_calls"])
        result = d.resize("actor", "regular", 2)
        assert (result.kept, result.started) == (("actor.regular.0",), ("actor.regular.1",))
        new = stats(d.engines()[1].url)
        assert (new["weight_version"], new["lora_adapters"], new["paused"]) == (
            "7",
            {"math": "/lora/math"},
            "in_place",
        )
        assert len(stats(d.engines()[0].url)["control_calls"]) == calls_before
        assert d.control.continue_generation().engines == ("actor.regular.0", "actor.regular.1")
        assert d.control.weight_versions() == {"actor.regular.0": "7", "actor.regular.1": "7"}


def test_removed_engines_take_no_new_request_and_finish_theirs(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Clients send requests without pause (each takes a while: the stand-ins' speed model) while the
    deployment shrinks from 4 engines to 2: requests are in flight while it changes, and none fails (the
    removed engines are out of their router first, then finish what they have, then stop)."""
    base = random_port_base()
    overrides = [
        "sglang.actor.num_gpus_per_engine=1",
        "sglang_deploy.standin.speed.enabled=true",
        "sglang_deploy.router.policy=round_robin",
        *FAST,
    ]
    with launch_from_config(
        cfg_of(*overrides, "sglang.actor.regular.num_gpus=4", port_base=base), log_dir=tmp_path / "logs"
    ) as d:
        url = d.registry.get_model_url("actor")
        outcomes: list[tuple[float, float, int | str]] = []
        stop = threading.Event()

        async def clients() -> None:
            async def client() -> None:
                async with httpx.AsyncClient(timeout=60) as http:
                    while not stop.is_set():
                        started = time.monotonic()
                        try:
                            r = await http.post(url, json=generate_body(max_new_tokens=16))
                            outcomes.append((started, time.monotonic(), r.status_code))
                        except httpx.HTTPError as exc:
                            outcomes.append((started, time.monotonic(), type(exc).__name__))

            await asyncio.gather(*(client() for _ in range(8)))

        load = threading.Thread(target=lambda: asyncio.run(clients()))
        load.start()
        try:
            while len(outcomes) < 8:  # the clients are at it
                time.sleep(0.05)
            removed = {e.id: e.url for e in d.engines()[2:]}
            applied_at = time.monotonic()
            result = d.resize("actor", "regular", 2)
            done_at = time.monotonic()
            time.sleep(0.5)
        finally:
            stop.set()
            load.join(timeout=60)
        assert result.stopped == tuple(removed)
        assert {o for _s, _e, o in outcomes} == {200}, sorted({str(o) for _s, _e, o in outcomes})
        assert any(s < done_at and e > applied_at for s, e, _o in outcomes)  # some were out during the change
        gone = [e for e in d.events() if e.kind == "engine_removed"]
        assert sorted(e.subject for e in gone) == sorted(removed)


def test_a_change_that_does_not_fit_is_refused_whole_and_nothing_changes(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    base = random_port_base()
    overrides = ["sglang.actor.num_gpus_per_engine=2", *FAST]
    with launch_from_config(
        cfg_of(*overrides, "sglang.actor.regular.num_gpus=4", port_base=base), log_dir=tmp_path / "logs"
    ) as d:
        before = pids(d)
        bad = cfg_of(
            *overrides,
            "sglang.actor.regular.num_gpus=5",
            "sglang_deploy.router.policy=random",
            port_base=base,
        )
        with pytest.raises(DeploymentConfigError) as exc:
            d.apply(bad)
        assert (
            "sglang.actor.regular.num_gpus: 5 GPUs do not split into engines of num_gpus_per_engine=2"
            in str(exc.value)
        )
        with pytest.raises(
            DeploymentConfigError,
            match=r"sglang_deploy.router.policy: cannot change on a running deployment \('cache_aware' -> 'random'\)",
        ):
            d.apply(
                cfg_of(
                    *overrides,
                    "sglang.actor.regular.num_gpus=4",
                    "sglang_deploy.router.policy=random",
                    port_base=base,
                )
            )
        dry = d.resize("actor", "regular", 8, dry_run=True)
        assert dry.dry_run and dry.started == ("actor.regular.2", "actor.regular.3")
        assert pids(d) == before and [e.state for e in d.engines()] == ["serving", "serving"]
        assert d.events() == ()


def test_a_model_is_added_with_a_router_of_its_own_and_removed_again(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    base = random_port_base()
    overrides = ["sglang.actor.regular.num_gpus=1", *FAST]
    reward = [
        "+sglang_model@sglang.reward=base",
        "sglang.reward.model_path=/rm",
        "sglang.reward.regular.num_gpus=1",
    ]
    with launch_from_config(cfg_of(*overrides, port_base=base), log_dir=tmp_path / "logs") as d:
        actor_pid = pids(d)["actor.regular.0"]
        added = d.apply(cfg_of(*overrides, *reward, port_base=base))
        assert (added.kept, added.started, added.diff.models_added) == (
            ("actor.regular.0",),
            ("reward.regular.0",),
            ("reward",),
        )
        assert d.registry.names() == ("actor", "reward")
        answer = httpx.post(d.registry.get_model_url("reward"), json=generate_body(), timeout=10)
        assert answer.status_code == 200
        removed = d.apply(cfg_of(*overrides, port_base=base))
        assert (removed.stopped, removed.diff.models_removed) == (("reward.regular.0",), ("reward",))
        assert d.registry.names() == ("actor",) and pids(d) == {"actor.regular.0": actor_pid}


def test_an_engine_whose_server_arguments_change_is_replaced_in_place(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """New overrides for decode: its engines are replaced on the same GPUs (new processes); prefill stays."""
    base = random_port_base()
    overrides = [
        "sglang=pd",
        "sglang.actor.prefill.num_gpus=1",
        "sglang.actor.decode.num_gpus=2",
        "sglang.actor.num_gpus_per_engine=1",
        *FAST,
    ]
    with launch_from_config(cfg_of(*overrides, port_base=base), log_dir=tmp_path / "logs") as d:
        before = pids(d)
        result = d.apply(
            cfg_of(*overrides, "+sglang.actor.decode.overrides.mem_fraction_static=0.7", port_base=base)
        )
        assert (result.kept, result.replaced) == (("actor.prefill.0",), ("actor.decode.0", "actor.decode.1"))
        after = pids(d)
        assert after["actor.prefill.0"] == before["actor.prefill.0"]
        assert all(after[e] != before[e] for e in result.replaced)
        assert [e.gpus for e in d.engines()] == ["0", "1", "2"]
        assert "--mem-fraction-static" in " ".join(d.fleet.engine("actor.decode.0").launches[0].argv)


def test_an_engine_added_after_a_broadcast_waits_for_the_weights_update_group(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    """Weights came through a weights update group: an added engine is outside it (as after a restart) and
    waits out of its router until the trainer forms the group again with it."""
    base = random_port_base()
    with launch_from_config(
        cfg_of("sglang.actor.regular.num_gpus=1", *FAST, port_base=base), log_dir=tmp_path / "logs"
    ) as d:
        d.control.background.init_weights_update_group("127.0.0.1", 29500).result(timeout=30)
        d.control.update_weights_from_distributed(["w"], ["bfloat16"], [[2]], weight_version="3")
        d.resize("actor", "regular", 2)
        assert [e.state for e in d.engines()] == ["serving", "pending_weights"]
        assert d.control.engines_outside_weight_group() == ("actor.regular.1",)
        assert len(listed(d)) == 1


def test_settings_a_running_deployment_cannot_take_are_each_named() -> None:
    from miles_sglang_plugin.config.schema import SGLangDeployConf

    old = SGLangDeployConf()
    new = SGLangDeployConf()
    new.router.policy = "random"
    new.api_key = "sk-secret-key"
    new.server_defaults = {"mem_fraction_static": 0.7}  # changes engines' command lines: they are replaced
    new.launch.drain_timeout_s = 5
    assert [str(p) for p in check_settings(old, new)] == [
        "sglang_deploy.api_key: cannot change on a running deployment (***): stop it and start the new one",
        "sglang_deploy.router.policy: cannot change on a running deployment ('cache_aware' -> 'random'): stop it "
        "and start the new one",
    ]


def test_plan_diff_shows_what_a_change_would_do(capsys: pytest.CaptureFixture[str]) -> None:
    from miles_sglang_plugin.cli import main

    common = ["hf_checkpoint=/c", "debug_rollout_only=true", "sglang.actor.num_gpus_per_engine=1"]
    old = "sglang=pd sglang.actor.prefill.num_gpus=4 sglang.actor.decode.num_gpus=4"
    new = "sglang=pd sglang.actor.prefill.num_gpus=2 sglang.actor.decode.num_gpus=6"
    assert main(["plan", "--diff", old, new, *common]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "would apply: 6 kept, 2 started, 2 stopped, 0 replaced"
    assert [line.split()[:2] for line in lines[1:11]] == [
        ["kept", "actor.prefill.0"],
        ["kept", "actor.prefill.1"],
        ["kept", "actor.decode.0"],
        ["kept", "actor.decode.1"],
        ["kept", "actor.decode.2"],
        ["kept", "actor.decode.3"],
        ["started", "actor.decode.4"],
        ["started", "actor.decode.5"],
        ["stopped", "actor.prefill.2"],
        ["stopped", "actor.prefill.3"],
    ]
    assert lines[7].endswith("- -> node 0 GPUs 2") and lines[11] == (
        "  placed unlike a fresh resolution: actor.decode.0 (fresh: node 0 GPUs 2)"
    )
    assert (
        main(
            [
                "plan",
                "--diff",
                old,
                "sglang=pd sglang.actor.prefill.num_gpus=3 sglang.actor.decode.num_gpus=3 sglang.actor.num_gpus_per_engine=2",
                *common,
            ]
        )
        == 2
    )
    assert "3 GPUs do not split into engines of num_gpus_per_engine=2" in capsys.readouterr().err
