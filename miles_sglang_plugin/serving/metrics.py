"""Metrics of a running deployment, for Prometheus: what the fleet looks like when it is scraped, and what
happened to it since it started.

* **Read from the fleet at each scrape** (:class:`DeploymentMetrics`, a collector of its own registry, never
  the process-wide one): engines per state of each model and group (every state of :class:`EngineState`
  listed, 0 where none), each engine's weight version (an info-style gauge), its restarts, each router's state
  and restarts.
* **Counted from the event log** (:meth:`DeploymentMetrics.observe_event`, called by the log as each event is
  emitted, so that an event a caller waited for is already counted): engine losses and recoveries per model
  and group, router losses and recoveries per model, every event by kind.
* **Told by the control handle and ``apply``**: control operations per name and outcome with their latency,
  applies per outcome with their duration.

:class:`MetricsServer` serves ``GET /metrics`` (Prometheus' text format, or OpenMetrics when the scraper asks
for it), the deployment's API key required when it has one. :func:`scrape_targets` lists what Prometheus can
scrape (every engine's ``/metrics``, every router's metrics port, the launcher's own page) as ``file_sd``
targets; :func:`write_targets` writes them to a file atomically.

No secret is in any name, label or target: the API key goes only into the server's check of the
``Authorization`` header.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from miles_sglang_plugin.addresses import host_port, http_base_url
from miles_sglang_plugin.serving.events import DeploymentEvent
from miles_sglang_plugin.serving.fleet import EngineRow, EngineState, Fleet, RouterRow, RouterState
from miles_sglang_plugin.serving.loopback_http import LoopbackServer, Reply

__all__ = [
    "APPLY_BUCKETS_S",
    "OPERATION_BUCKETS_S",
    "PATH",
    "PREFIX",
    "DeploymentMetrics",
    "MetricsServer",
    "TargetsFile",
    "scrape_targets",
    "write_targets",
]

#: The prefix of every metric the launcher exports.
PREFIX = "miles_sglang"
PATH = "/metrics"
#: The ``job`` label of each kind of target.
ENGINE_JOB = "sglang-engine"
ROUTER_JOB = "sglang-router"
LAUNCHER_JOB = "miles-sglang"
#: Histogram buckets (seconds): a control operation (a cache flush takes milliseconds, a weight update from
#: disk minutes), and an apply (engines started, caught up and drained).
OPERATION_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
APPLY_BUCKETS_S = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0)

#: Event kinds counted as an engine's loss, and as its return after one.
_LOSSES = frozenset({"engine_lost", "external_engine_lost"})
_RECOVERIES = frozenset({"engine_recovered", "external_engine_back"})
_ROUTER = "router."


class DeploymentMetrics(Collector):
    """The metrics of one deployment, in :attr:`registry` (see the module docstring). ``weight_version(engine)``
    is what the deployment knows the engine has (None: unknown)."""

    def __init__(
        self, fleet: Fleet, weight_version: Callable[[str], str | None] = lambda _engine: None
    ) -> None:
        self._fleet = fleet
        self._weight_version = weight_version
        self._lock = threading.Lock()
        self._losses: dict[tuple[str, str], int] = {}
        self._recoveries: dict[tuple[str, str], int] = {}
        self._router_losses: dict[str, int] = {}
        self._router_recoveries: dict[str, int] = {}
        self._events: dict[str, int] = {}
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._operations = Counter(
            f"{PREFIX}_control_operations",
            "Control operations the trainer sent (a rolling update counts once), by outcome: ok when every "
            "engine it was sent to accepted it, failed otherwise",
            ["operation", "outcome"],
            registry=self.registry,
        )
        self._operation_seconds = Histogram(
            f"{PREFIX}_control_operation_seconds",
            "Seconds from a control operation's call to its result",
            ["operation"],
            buckets=OPERATION_BUCKETS_S,
            registry=self.registry,
        )
        self._applies = Counter(
            f"{PREFIX}_applies",
            "Changes of the running deployment (apply, resize, move_gpus; dry runs not counted), by outcome: "
            "done, timed_out (it goes on), refused (nothing changed), failed",
            ["outcome"],
            registry=self.registry,
        )
        self._apply_seconds = Histogram(
            f"{PREFIX}_apply_seconds",
            "Seconds from an apply's call to its end",
            buckets=APPLY_BUCKETS_S,
            registry=self.registry,
        )

    # ------------------------------------------------------------------------------------------ told
    def observe_event(self, event: DeploymentEvent) -> None:
        """Count ``event`` (quick: called as it is emitted)."""
        with self._lock:
            self._events[event.kind] = self._events.get(event.kind, 0) + 1
            if event.kind in _LOSSES or event.kind in _RECOVERIES:
                key = self._group_of(event.subject)
                counts = self._losses if event.kind in _LOSSES else self._recoveries
                counts[key] = counts.get(key, 0) + 1
            elif event.kind in ("router_lost", "router_recovered"):
                model = event.subject.removeprefix(_ROUTER)
                router_counts = (
                    self._router_losses if event.kind == "router_lost" else self._router_recoveries
                )
                router_counts[model] = router_counts.get(model, 0) + 1

    def _group_of(self, engine: str) -> tuple[str, str]:
        try:
            row = self._fleet.engine(engine)
        except KeyError:  # no longer in the fleet (an event told late)
            return "", ""
        return row.model, row.group

    def operation_done(self, operation: str, seconds: float, ok: bool) -> None:
        """A control operation ended (``ok``: every engine it was sent to accepted it)."""
        self._operations.labels(operation, "ok" if ok else "failed").inc()
        self._operation_seconds.labels(operation).observe(seconds)

    def apply_done(self, seconds: float, outcome: str) -> None:
        """An apply ended: ``done``, ``timed_out``, ``refused`` or ``failed``."""
        self._applies.labels(outcome).inc()
        self._apply_seconds.observe(seconds)

    # ------------------------------------------------------------------------------------------ read
    def collect(self) -> Iterable[Metric]:
        engines = [row for row in self._fleet.engines() if row.state is not EngineState.STOPPED]
        routers = [row for row in self._fleet.routers() if row.state is not RouterState.STOPPED]
        groups = list(dict.fromkeys((row.model, row.group) for row in engines))
        yield self._engine_states(engines, groups)
        info = InfoMetricFamily(
            f"{PREFIX}_engine_weight_version",
            "The weight version each engine has as far as the deployment knows (its command line's, then what "
            "the weight updates it accepted set; empty: unknown)",
            labels=["engine", "model", "group", "worker_type"],
        )
        restarts = CounterMetricFamily(
            f"{PREFIX}_engine_restarts",
            "Restarts of each engine after a loss",
            labels=["engine", "model", "group"],
        )
        for row in engines:
            version = self._weight_version(row.id)
            info.add_metric(
                [row.id, row.model, row.group, row.worker_type], {"weight_version": version or ""}
            )
            restarts.add_metric([row.id, row.model, row.group], row.restarts)
        yield info
        yield restarts
        yield from self._routers(routers)
        yield from self._counted(groups, [row.model for row in routers])

    @staticmethod
    def _engine_states(engines: Sequence[EngineRow], groups: Sequence[tuple[str, str]]) -> Metric:
        counts: dict[tuple[str, str, str], int] = {}
        for row in engines:
            key = (row.model, row.group, row.state.value)
            counts[key] = counts.get(key, 0) + 1
        family = GaugeMetricFamily(
            f"{PREFIX}_engines",
            "Engines of each model and group in each state (every state listed, 0 where none)",
            labels=["model", "group", "state"],
        )
        for model, group in groups:
            for state in EngineState:
                family.add_metric([model, group, state.value], counts.get((model, group, state.value), 0))
        return family

    @staticmethod
    def _routers(routers: Sequence[RouterRow]) -> Iterable[Metric]:
        state = GaugeMetricFamily(
            f"{PREFIX}_router_state",
            "The state of each model's router: 1 for the state it is in, 0 for the others",
            labels=["model", "state"],
        )
        restarts = CounterMetricFamily(
            f"{PREFIX}_router_restarts", "Restarts of each model's router", labels=["model"]
        )
        for row in routers:
            for each in RouterState:
                state.add_metric([row.model, each.value], 1 if row.state is each else 0)
            restarts.add_metric([row.model], row.restarts)
        yield state
        yield restarts

    def _counted(self, groups: Sequence[tuple[str, str]], models: Sequence[str]) -> Iterable[Metric]:
        with self._lock:
            losses, recoveries = dict(self._losses), dict(self._recoveries)
            router_losses, router_recoveries = dict(self._router_losses), dict(self._router_recoveries)
            events = dict(self._events)
        for name, doc, counts in (
            ("engine_losses", "Engines lost (exited or stopped answering), external ones included", losses),
            ("engine_recoveries", "Engines that serve again after a loss", recoveries),
        ):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model", "group"])
            for key in dict.fromkeys([*groups, *counts]):
                family.add_metric(list(key), counts.get(key, 0))
            yield family
        for name, doc, per_model in (
            ("router_losses", "Routers lost (exited or stopped answering)", router_losses),
            ("router_recoveries", "Routers that serve again after a loss", router_recoveries),
        ):
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model"])
            for model in dict.fromkeys([*models, *per_model]):
                family.add_metric([model], per_model.get(model, 0))
            yield family
        family = CounterMetricFamily(
            f"{PREFIX}_events", "Events of the deployment by kind (deployment.events())", labels=["kind"]
        )
        for kind, count in sorted(events.items()):
            family.add_metric([kind], count)
        yield family

    def page(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition (body, content type) in the format ``accept`` (an HTTP Accept header) asks for."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


# ------------------------------------------------------------------------------------------------ serving
class MetricsServer(LoopbackServer):
    """Serves ``page(accept)`` at ``GET /metrics`` on ``host:port`` (port 0: one the system picks); with
    ``api_key``, a request without ``Authorization: Bearer <key>`` is answered 401."""

    def __init__(
        self,
        page: Callable[[str], tuple[bytes, str]],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
    ) -> None:
        def answer(path: str, accept: str) -> Reply:
            if path == PATH:
                return (HTTPStatus.OK, *page(accept))
            return HTTPStatus.NOT_FOUND, f"no route {PATH} here\n".encode(), "text/plain"

        super().__init__(
            answer,
            unauthorized=(HTTPStatus.UNAUTHORIZED, b"missing or wrong Authorization\n", "text/plain"),
            name="msp-metrics",
            host=host,
            port=port,
            api_key=api_key,
        )

    @property
    def url(self) -> str:
        return http_base_url(self.host, self.port) + PATH


# ------------------------------------------------------------------------------------------------ targets
def _engine_target(url: str) -> tuple[str, dict[str, str]]:
    """``host:port`` of an engine's URL and the labels that point Prometheus at its ``/metrics`` (a scheme
    other than http, a path prefix); user and password of the URL are left out."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    extra = {}
    if parts.scheme and parts.scheme != "http":
        extra["__scheme__"] = parts.scheme
    if parts.path.strip("/"):
        extra["__metrics_path__"] = parts.path.rstrip("/") + PATH
    return host_port(host, port), extra


def scrape_targets(fleet: Fleet, launcher: str | None = None) -> list[dict[str, Any]]:
    """Prometheus ``file_sd`` targets: every engine of ``fleet`` not stopped (``job`` sglang-engine, labels
    model, group, engine, worker_type and node: the plan's node index, absent for an external engine), every
    router's metrics port (sglang-router, model) and the launcher's own page at ``launcher`` (host:port;
    miles-sglang)."""
    out: list[dict[str, Any]] = []
    for row in fleet.engines():
        if row.state is EngineState.STOPPED:
            continue
        address, extra = _engine_target(row.url)
        labels = {
            "job": ENGINE_JOB,
            "model": row.model,
            "group": row.group,
            "engine": row.id,
            "worker_type": row.worker_type,
            **({"node": str(row.node)} if row.node is not None else {}),
            **extra,
        }
        out.append({"targets": [address], "labels": labels})
    for router in fleet.routers():
        if router.state is RouterState.STOPPED:
            continue
        spec = router.launch.spec
        out.append(
            {
                "targets": [host_port(spec.host, spec.prometheus_port)],
                "labels": {"job": ROUTER_JOB, "model": router.model},
            }
        )
    if launcher is not None:
        out.append({"targets": [launcher], "labels": {"job": LAUNCHER_JOB}})
    return out


def write_targets(path: Path, targets: Sequence[Mapping[str, Any]]) -> None:
    """Write ``targets`` to ``path`` as JSON, atomically (a temporary file of mode 0600 in the same folder,
    renamed over it: Prometheus never reads half a file). A ``path`` that is a symbolic link is refused
    (ValueError): the file is replaced, never written through a link."""
    if path.is_symlink():
        raise ValueError(
            f"{path} is a symbolic link: give the targets file's own path (it is replaced whole)"
        )
    raw = (json.dumps(list(targets), indent=2, sort_keys=True) + "\n").encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(raw)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class TargetsFile:
    """A targets file kept current: :meth:`refresh` writes it again whenever ``targets()`` changed."""

    def __init__(self, path: Path, targets: Callable[[], list[dict[str, Any]]]) -> None:
        if path.is_symlink():
            raise ValueError(
                f"{path} is a symbolic link: give the targets file's own path (it is replaced whole)"
            )
        self.path = path
        self._targets = targets
        self._lock = threading.Lock()
        self._written: list[dict[str, Any]] | None = None

    def refresh(self) -> None:
        with self._lock:
            now = self._targets()
            if now != self._written:
                write_targets(self.path, now)
                self._written = now
