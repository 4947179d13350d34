"""The deployment's metrics (``serving/metrics.py``): the collector on fleets built by hand, the targets and
their file, the ``/metrics`` server; then a live deployment of two stand-in engines scraped over HTTP through a
loss, a weight version update and a resize.

Every value below is worked out by hand from the fleet or the actions each test gives."""

from __future__ import annotations

# ruff: noqa: F811  (pytest fixtures imported from other modules, redefined as arguments)
import json
import os
import signal
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from miles_sglang_plugin.app.hydra_edge import launch_from_config
from miles_sglang_plugin.errors import DeploymentConfigError
from miles_sglang_plugin.serving.events import DeploymentEvent, EventLog
from miles_sglang_plugin.serving.fleet import EngineState, Fleet, RouterState
from miles_sglang_plugin.serving.metrics import (
    DeploymentMetrics,
    MetricsServer,
    TargetsFile,
    scrape_targets,
    write_targets,
)
from tests.conftest_launch import leak_check  # noqa: F401  (fixture)
from tests.launch_helpers import LeakTracker, compose
from tests.test_reconciler_policy import engine, router

S = EngineState
#: The states of serving/fleet.py's EngineState, as the issue of the metrics lists them (11).
ALL_STATES = (
    "new",
    "starting",
    "catching_up",
    "serving",
    "updating",
    "pending_weights",
    "lost",
    "restarting",
    "draining",
    "failed",
    "stopped",
)
SECRET = "sk-metrics-S3CRET"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of a Prometheus text page: (sample name, its labels) -> value."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def of(samples: Samples, name: str) -> dict[frozenset[tuple[str, str]], float]:
    return {labels: v for (n, labels), v in samples.items() if n == name}


def event(kind: str, subject: str) -> DeploymentEvent:
    return DeploymentEvent(kind, subject, f"{kind} of {subject}", 0.0, 0.0)


def hand_fleet() -> Fleet:
    """actor/regular: .0 serving, .1 lost after 2 restarts, .2 stopped (left out); judge/external: one
    starting; the actor's router ready, the judge's lost after 1 restart."""
    return Fleet(
        [
            engine("actor.regular.0"),
            engine("actor.regular.1", state=S.LOST, restarts=2),
            engine("actor.regular.2", state=S.STOPPED),
            engine("judge.external.0", state=S.STARTING, external=True, model="judge"),
        ],
        [router("actor"), router("judge", state=RouterState.LOST, restarts=1)],
    )


def scrape(metrics: DeploymentMetrics) -> Samples:
    return parse(generate_latest(metrics.registry).decode())


# ------------------------------------------------------------------------------------------- collector
def test_engines_per_state_list_every_state_of_each_group_and_leave_stopped_engines_out() -> None:
    samples = scrape(DeploymentMetrics(hand_fleet()))
    engines = of(samples, "miles_sglang_engines")
    assert len(engines) == 2 * 11  # two groups, every state
    expected = {("actor", "regular", s): 0.0 for s in ALL_STATES}
    expected |= {("judge", "external", s): 0.0 for s in ALL_STATES}
    expected |= {("actor", "regular", "serving"): 1.0, ("actor", "regular", "lost"): 1.0}
    expected |= {("judge", "external", "starting"): 1.0}
    got = {(dict(k)["model"], dict(k)["group"], dict(k)["state"]): v for k, v in engines.items()}
    assert got == expected


def test_each_engine_has_its_weight_version_and_restarts() -> None:
    versions = {"actor.regular.0": "5", "actor.regular.1": "default"}
    samples = scrape(DeploymentMetrics(hand_fleet(), versions.get))
    info = {
        (dict(k)["engine"], dict(k)["weight_version"], dict(k)["worker_type"]): v
        for k, v in of(samples, "miles_sglang_engine_weight_version_info").items()
    }
    assert info == {
        ("actor.regular.0", "5", "regular"): 1.0,
        ("actor.regular.1", "default", "regular"): 1.0,
        ("judge.external.0", "", "regular"): 1.0,  # unknown: an external engine that took no update
    }
    restarts = {dict(k)["engine"]: v for k, v in of(samples, "miles_sglang_engine_restarts_total").items()}
    assert restarts == {"actor.regular.0": 0.0, "actor.regular.1": 2.0, "judge.external.0": 0.0}


def test_router_state_is_one_for_its_state_and_zero_for_the_other_six() -> None:
    samples = scrape(DeploymentMetrics(hand_fleet()))
    states = of(samples, "miles_sglang_router_state")
    assert len(states) == 2 * 7
    ones = sorted((dict(k)["model"], dict(k)["state"]) for k, v in states.items() if v == 1.0)
    assert ones == [("actor", "ready"), ("judge", "lost")]
    assert value(samples, "miles_sglang_router_restarts_total", model="judge") == 1.0
    assert value(samples, "miles_sglang_router_restarts_total", model="actor") == 0.0


def test_losses_and_recoveries_are_counted_from_the_events_per_model_and_group() -> None:
    metrics = DeploymentMetrics(hand_fleet())
    before = scrape(metrics)
    # zero from the start for every group and router: increase() sees the first loss
    assert value(before, "miles_sglang_engine_losses_total", model="actor", group="regular") == 0.0
    assert value(before, "miles_sglang_router_losses_total", model="judge") == 0.0
    for kind, subject in [
        ("engine_lost", "actor.regular.1"),
        ("engine_restarting", "actor.regular.1"),
        ("engine_recovered", "actor.regular.1"),
        ("engine_lost", "actor.regular.1"),
        ("external_engine_lost", "judge.external.0"),
        ("router_lost", "router.judge"),
        ("router_recovered", "router.judge"),
    ]:
        metrics.observe_event(event(kind, subject))
    samples = scrape(metrics)
    assert value(samples, "miles_sglang_engine_losses_total", model="actor", group="regular") == 2.0
    assert value(samples, "miles_sglang_engine_losses_total", model="judge", group="external") == 1.0
    assert value(samples, "miles_sglang_engine_recoveries_total", model="actor", group="regular") == 1.0
    assert value(samples, "miles_sglang_engine_recoveries_total", model="judge", group="external") == 0.0
    assert value(samples, "miles_sglang_router_losses_total", model="judge") == 1.0
    assert value(samples, "miles_sglang_router_recoveries_total", model="judge") == 1.0
    assert value(samples, "miles_sglang_router_losses_total", model="actor") == 0.0
    kinds = {dict(k)["kind"]: v for k, v in of(samples, "miles_sglang_events_total").items()}
    assert kinds == {
        "engine_lost": 2.0,
        "engine_restarting": 1.0,
        "engine_recovered": 1.0,
        "external_engine_lost": 1.0,
        "router_lost": 1.0,
        "router_recovered": 1.0,
    }


def test_control_operations_and_applies_land_in_their_buckets() -> None:
    metrics = DeploymentMetrics(hand_fleet())
    metrics.operation_done("flush_cache", 0.3, True)
    metrics.operation_done("flush_cache", 4.0, False)
    metrics.apply_done(42.0, "done")
    s = scrape(metrics)
    assert value(s, "miles_sglang_control_operations_total", operation="flush_cache", outcome="ok") == 1.0
    assert value(s, "miles_sglang_control_operations_total", operation="flush_cache", outcome="failed") == 1.0
    bucket = "miles_sglang_control_operation_seconds_bucket"
    # 0.3 s is above 0.25 and within 0.5; 4.0 s within 5.0
    assert value(s, bucket, operation="flush_cache", le="0.25") == 0.0
    assert value(s, bucket, operation="flush_cache", le="0.5") == 1.0
    assert value(s, bucket, operation="flush_cache", le="2.5") == 1.0
    assert value(s, bucket, operation="flush_cache", le="5.0") == 2.0
    assert value(s, "miles_sglang_control_operation_seconds_sum", operation="flush_cache") == 4.3
    assert value(s, "miles_sglang_applies_total", outcome="done") == 1.0
    assert value(s, "miles_sglang_apply_seconds_bucket", le="30.0") == 0.0
    assert value(s, "miles_sglang_apply_seconds_bucket", le="60.0") == 1.0


def test_each_deployment_has_a_registry_of_its_own() -> None:
    """Two deployments in one process export each their own counts (never the process-wide registry)."""
    one, two = DeploymentMetrics(hand_fleet()), DeploymentMetrics(hand_fleet())
    one.operation_done("abort_all", 0.01, True)
    assert value(scrape(one), "miles_sglang_control_operations_total", operation="abort_all", outcome="ok")
    assert not of(scrape(two), "miles_sglang_control_operations_total")
    from prometheus_client import REGISTRY

    assert REGISTRY.get_sample_value("miles_sglang_control_operations_total") is None


def test_an_event_is_counted_before_a_waiter_sees_it() -> None:
    """The log's tap runs within emit before the event is kept: whoever waits for the event finds it counted;
    a tap that raises is logged and the event still kept."""
    log = EventLog()
    seen: list[tuple[str, int]] = []
    log.tap(lambda e: seen.append((e.kind, len(log.events()))))
    log.tap(lambda e: 1 / 0)  # type: ignore[func-returns-value]
    log.emit("engine_lost", "actor.regular.0", "lost")
    assert log.wait_for("engine_lost", timeout_s=1).subject == "actor.regular.0"
    assert seen == [("engine_lost", 0)]  # not yet in the log when it was counted


# --------------------------------------------------------------------------------------------- targets
def test_targets_list_every_engine_router_and_the_launcher_with_their_labels() -> None:
    fleet = Fleet(
        [
            engine("actor.regular.0", url="http://127.0.0.1:31000"),
            engine("actor.regular.1", url="http://[::1]:31010", node=1, worker_type="decode"),
            engine("actor.regular.2", url="http://127.0.0.1:31020", state=S.STOPPED),
            engine(
                "judge.external.0",
                url="https://user:pw@judge.example:8443/v1/",
                external=True,
                model="judge",
                state=S.STARTING,
            ),
        ],
        [router("actor")],  # host 127.0.0.1, metrics port 30001
    )
    targets = scrape_targets(fleet, "127.0.0.1:9400")
    assert targets == [
        {
            "targets": ["127.0.0.1:31000"],
            "labels": {
                "job": "sglang-engine",
                "model": "actor",
                "group": "regular",
                "engine": "actor.regular.0",
                "worker_type": "regular",
                "node": "0",
            },
        },
        {
            "targets": ["[::1]:31010"],
            "labels": {
                "job": "sglang-engine",
                "model": "actor",
                "group": "regular",
                "engine": "actor.regular.1",
                "worker_type": "decode",
                "node": "1",
            },
        },
        {
            "targets": ["judge.example:8443"],
            "labels": {
                "job": "sglang-engine",
                "model": "judge",
                "group": "external",
                "engine": "judge.external.0",
                "worker_type": "regular",
                "__scheme__": "https",
                "__metrics_path__": "/v1/metrics",
            },
        },
        {"targets": ["127.0.0.1:30001"], "labels": {"job": "sglang-router", "model": "actor"}},
        {"targets": ["127.0.0.1:9400"], "labels": {"job": "miles-sglang"}},
    ]
    assert "pw" not in json.dumps(targets)  # the URL's password is no target's


def test_the_targets_file_is_replaced_whole_with_mode_0600(tmp_path: Path) -> None:
    path = tmp_path / "targets.json"
    path.write_text("old")
    path.chmod(0o644)
    write_targets(path, [{"targets": ["h:1"], "labels": {"job": "j"}}])
    assert json.loads(path.read_text()) == [{"targets": ["h:1"], "labels": {"job": "j"}}]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["targets.json"]  # no temporary file left


def test_a_targets_path_that_is_a_symbolic_link_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere"
    real.write_text("keep me")
    link = tmp_path / "targets.json"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=r"targets\.json is a symbolic link"):
        write_targets(link, [])
    with pytest.raises(ValueError, match=r"targets\.json is a symbolic link"):
        TargetsFile(link, list)
    assert real.read_text() == "keep me"


def test_the_targets_file_is_written_again_only_when_the_targets_change(tmp_path: Path) -> None:
    now: list[dict[str, Any]] = [{"targets": ["a:1"], "labels": {}}]
    kept = TargetsFile(tmp_path / "t.json", lambda: [dict(t) for t in now])
    kept.refresh()
    first = (tmp_path / "t.json").stat().st_ino
    kept.refresh()
    assert (tmp_path / "t.json").stat().st_ino == first  # unchanged: not written again
    now.append({"targets": ["b:2"], "labels": {}})
    kept.refresh()
    assert json.loads((tmp_path / "t.json").read_text()) == now


# ---------------------------------------------------------------------------------------------- server
def test_the_metrics_page_asks_for_the_api_key_where_one_is_set() -> None:
    metrics = DeploymentMetrics(hand_fleet())
    server = MetricsServer(metrics.page, api_key=SECRET)
    try:
        assert httpx.get(server.url, timeout=10).status_code == 401
        wrong = httpx.get(server.url, headers={"Authorization": "Bearer nope"}, timeout=10)
        assert wrong.status_code == 401
        auth = {"Authorization": f"Bearer {SECRET}"}
        page = httpx.get(server.url, headers=auth, timeout=10)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
        assert value(parse(page.text), "miles_sglang_engines", model="actor", group="regular", state="lost")
        assert SECRET not in page.text
        other = httpx.get(server.url.replace("/metrics", "/other"), headers=auth, timeout=10)
        assert other.status_code == 404
    finally:
        server.close()


# ------------------------------------------------------------------------------------------------ live
FAST = [
    "sglang_deploy.supervision.health_interval_s=0.3",
    "sglang_deploy.supervision.health_timeout_s=0.5",
    "sglang_deploy.supervision.restart_backoff_s=0.1",
    "sglang_deploy.supervision.kill_grace_s=0.5",
]


def scrape_url(url: str) -> Samples:
    answer = httpx.get(url, headers={"Authorization": f"Bearer {SECRET}"}, timeout=10)
    assert answer.status_code == 200
    assert SECRET not in answer.text
    return parse(answer.text)


def states(samples: Samples) -> dict[str, float]:
    return {
        dict(k)["state"]: v
        for k, v in of(samples, "miles_sglang_engines").items()
        if dict(k)["model"] == "actor" and dict(k)["group"] == "regular"
    }


def engine_targets(path: Path) -> list[Mapping[str, Any]]:
    text = path.read_text()
    assert SECRET not in text
    return [t for t in json.loads(text) if t["labels"]["job"] == "sglang-engine"]


def test_a_live_deployment_scraped_through_a_loss_a_version_update_and_a_resize(
    tmp_path: Path, leak_check: LeakTracker
) -> None:
    cfg = compose(
        "sglang.actor.num_gpus_per_engine=1",
        "sglang.actor.regular.num_gpus=2",
        f"sglang_deploy.api_key='{SECRET}'",
        *FAST,
    )
    targets = tmp_path / "prometheus" / "targets.json"
    targets.parent.mkdir()
    with launch_from_config(cfg, log_dir=tmp_path / "logs") as d:
        url = d.serve_metrics()
        assert httpx.get(url, timeout=10).status_code == 401  # the deployment's API key is asked for
        d.write_metrics_targets(targets)
        assert stat.S_IMODE(targets.stat().st_mode) == 0o600
        listed = engine_targets(targets)
        assert [t["labels"]["engine"] for t in listed] == ["actor.regular.0", "actor.regular.1"]
        assert [t["targets"] for t in listed] == [[e.url.removeprefix("http://")] for e in d.engines()]
        assert [t["labels"]["node"] for t in listed] == ["0", "0"]
        jobs = [t["labels"]["job"] for t in json.loads(targets.read_text())]
        assert jobs == ["sglang-engine", "sglang-engine", "sglang-router", "miles-sglang"]

        # after start: both serving, 0 in the 10 other states
        assert states(scrape_url(url)) == {s: (2.0 if s == "serving" else 0.0) for s in ALL_STATES}

        since = len(d.events())
        os.kill(d.fleet.engine("actor.regular.0").processes[0].pid, signal.SIGKILL)  # type: ignore[attr-defined]
        d.wait_for_event("engine_recovered", subject="actor.regular.0", since=since, timeout_s=120)
        s = scrape_url(url)
        assert value(s, "miles_sglang_engine_losses_total", model="actor", group="regular") == 1.0
        assert value(s, "miles_sglang_engine_recoveries_total", model="actor", group="regular") == 1.0
        restarts = {dict(k)["engine"]: v for k, v in of(s, "miles_sglang_engine_restarts_total").items()}
        assert restarts == {"actor.regular.0": 1.0, "actor.regular.1": 0.0}
        assert states(s)["serving"] == 2.0

        d.control.update_weight_version("5")
        s = scrape_url(url)
        versions = {
            dict(k)["engine"]: dict(k)["weight_version"]
            for k in of(s, "miles_sglang_engine_weight_version_info")
        }
        assert versions == {"actor.regular.0": "5", "actor.regular.1": "5"}
        ops = "miles_sglang_control_operations_total"
        assert value(s, ops, operation="update_weight_version", outcome="ok") == 1.0
        assert (
            value(s, "miles_sglang_control_operation_seconds_count", operation="update_weight_version") == 1.0
        )

        d.control.query("/no_such_route", check=False)  # both engines answer 404: the operation failed
        assert value(scrape_url(url), ops, operation="query", outcome="failed") == 1.0

        other_key = compose(
            "sglang.actor.num_gpus_per_engine=1",
            "sglang.actor.regular.num_gpus=2",
            "sglang_deploy.api_key='sk-another'",
            *FAST,
        )
        with pytest.raises(DeploymentConfigError, match=r"sglang_deploy\.api_key"):
            d.apply(other_key)  # refused before anything changes
        assert d.resize("actor", "regular", 3, dry_run=True).started == ("actor.regular.2",)  # not counted
        result = d.resize("actor", "regular", 3)
        assert result.started == ("actor.regular.2",)
        listed = engine_targets(targets)
        assert [t["labels"]["engine"] for t in listed] == [
            "actor.regular.0",
            "actor.regular.1",
            "actor.regular.2",
        ]
        s = scrape_url(url)
        assert value(s, "miles_sglang_applies_total", outcome="done") == 1.0
        assert value(s, "miles_sglang_applies_total", outcome="refused") == 1.0
        assert value(s, "miles_sglang_apply_seconds_count") == 2.0
        assert states(s)["serving"] == 3.0
    assert json.loads(targets.read_text()) == []  # nothing runs any more: no target left
