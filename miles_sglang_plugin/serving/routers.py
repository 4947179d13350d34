"""A model's router: the command that starts it, what its control API does on the wire, and the reading of
its worker list against the workers it should hold.

The calls themselves are the reconciler's, asynchronous, on the deployment's kept HTTP clients
(:mod:`.router_client` over :mod:`.wire`); the router's settings and launch spec are
:mod:`miles_sglang_plugin.rendering.router_specs`. What sglang-router 0.3.2 does on the wire (checked against
the real router in ``tests/test_routers.py``; SMG 1.13.0's differences after the list):

* ``POST /workers {"url", "worker_type", "bootstrap_port"?, "api_key"?}`` answers **202** with
  ``{"status": "accepted", "worker_id", "url", "location", "message"}``; the worker is probed (``/health``,
  ``/server_info``, ``/model_info``) and added in the background, usually within ~0.1 s. A worker that is down
  is retried until ``worker_startup_timeout_secs`` (1800 s by default) and is not listed meanwhile.
* ``GET /workers`` answers ``{"workers": [{"id", "url", "model_id", "priority", "cost", "worker_type",
  "is_healthy", "load", "connection_mode", "bootstrap_port"? (prefill), "metadata": {...},
  "disable_health_check"}], "total": n, "stats": {"prefill_count", "decode_count", "regular_count"}}``.
* ``GET /readiness`` answers 200 ``{"status": "ready", "healthy_workers": n, "total_workers": n}`` or 503
  ``{"status": "not ready", "reason": "insufficient healthy workers"}``; in PD mode it needs a healthy prefill
  *and* decode worker. It does not need the API key.
* ``DELETE /workers/{id}`` answers 202 (removal queued).
* With an API key, ``/workers`` and ``/generate`` answer 401 without ``Authorization: Bearer <key>``.
* A second ``POST /workers`` of a registered URL answers 202 and changes nothing (its job fails in the log).
* ``labels`` given to ``POST /workers`` are listed in the worker's ``metadata``.
* dp-aware (``dp_aware``): a worker is listed once per data-parallel rank (``url@0``, ``url@1``, ...), and
  ``DELETE /workers/{id}`` of such an entry answers 202 but removes nothing (its job looks for ``url@0@``).

SMG 1.13.0, where it differs:

* A ``POST /workers`` of a URL the router holds answers **409** ``{"code": "WORKER_ALREADY_EXISTS"}`` (also
  while that URL's registration is still in progress): :func:`.router_client.register` then takes the
  listed entries out and posts again, until its deadline.
* ``DELETE /workers/{id}`` takes the worker out of routing at once, but the entry stays listed (and a new
  ``POST`` of its URL answers 409) for the Rust router's ``drain_settle_secs`` (SMG's default 5 s; the routers
  here get ``sglang_deploy.router.drain_settle_secs``, 0 by default); dp-aware entries are removed too.
* ``labels`` are listed under ``labels`` (with SMG's own, e.g. ``model_path``), and in ``/v1/rl/workers``.
* SIGTERM: the router keeps listening for 5 s (its load-balancer propagation window, whatever
  ``drain_settle_secs``) before it drains and exits.
"""

from __future__ import annotations

import json
import os
import site
import sys
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

from miles_sglang_plugin.rendering.router_specs import RouterLaunchSpec, WorkerRegistration

__all__ = [
    "API_KEY_ENV",
    "others_note",
    "registration_problems",
    "router_command",
    "same_worker",
]

#: The router process reads its API key from here (never from argv, which ``ps`` shows to every user).
API_KEY_ENV = "MSP_ROUTER_API_KEY"
ROUTER_MAIN_MODULE = "miles_sglang_plugin.serving.router_main"


# ----------------------------------------------------------------------------------------------------
# Launch command
# ----------------------------------------------------------------------------------------------------
def _source_root_env() -> dict[str, str]:
    """PYTHONPATH entry for a source checkout that is not installed, so ``-m`` works from any cwd."""
    root = Path(__file__).resolve().parents[2]
    site_dirs = {Path(p).resolve() for p in [*site.getsitepackages(), site.getusersitepackages()]}
    if root in site_dirs:
        return {}
    existing = os.environ.get("PYTHONPATH")
    parts = [str(root)] + ([existing] if existing else [])
    return {"PYTHONPATH": os.pathsep.join(parts)}


def router_command(
    spec: RouterLaunchSpec,
    python: str = sys.executable,
    workers: Iterable[WorkerRegistration] = (),
) -> tuple[list[str], dict[str, str]]:
    """``(argv, extra_env)`` that start the router of ``spec`` (with ``workers`` registered from its start):
    ``python -m miles_sglang_plugin.serving.router_main``.

    The spec travels as JSON in argv; the API key never does (argv is world-readable through ``ps``): it is
    in ``extra_env[MSP_ROUTER_API_KEY]``. Merge ``extra_env`` over ``os.environ`` when starting the process.
    """
    argv = [python, "-m", ROUTER_MAIN_MODULE, "--spec-json", spec.to_json()]
    listed = [w.payload() for w in workers]
    if listed:
        argv += ["--workers-json", json.dumps(listed)]
    env = _source_root_env()
    env["PYTHONUNBUFFERED"] = "1"
    if spec.api_key is not None:
        env[API_KEY_ENV] = spec.api_key
    return argv, env


# ----------------------------------------------------------------------------------------------------
# Reading a router's list
# ----------------------------------------------------------------------------------------------------
def same_worker(listed_url: Any, url: str) -> bool:
    """A router entry belongs to ``url``; dp-aware routers list ``url@rank`` per data-parallel rank."""
    listed = str(listed_url or "").rstrip("/")
    return listed == url or listed.startswith(url + "@")


def _entry_problem(entry: dict[str, Any], expected: WorkerRegistration) -> str | None:
    """What is wrong with a router's entry for an expected worker (None: registered as expected, healthy)."""
    label = entry.get("url", expected.url)
    worker_type = entry.get("worker_type")
    if worker_type != expected.worker_type:
        return f"{label} registered as {worker_type!r}, expected {expected.worker_type!r}"
    if expected.worker_type == "prefill" and entry.get("bootstrap_port") != expected.bootstrap_port:
        got = entry.get("bootstrap_port")
        return f"{label} has bootstrap_port {got!r}, expected {expected.bootstrap_port!r}"
    if not entry.get("is_healthy", False):
        return f"{label} ({worker_type}) registered but not healthy"
    return None


def registration_problems(
    workers: list[dict[str, Any]], expected: Collection[WorkerRegistration]
) -> dict[str, list[str]]:
    """Expected worker URL -> what is missing or wrong about it (only workers with problems)."""
    problems: dict[str, list[str]] = {}
    for worker in expected:
        entries = [listed for listed in workers if same_worker(listed.get("url"), worker.url)]
        if not entries:
            problems.setdefault(worker.url, []).append(f"{worker.describe()} not registered yet")
            continue
        for entry in entries:
            problem = _entry_problem(entry, worker)
            if problem is not None:
                problems.setdefault(worker.url, []).append(problem)
    return problems


def others_note(workers: list[dict[str, Any]], expected: Collection[WorkerRegistration]) -> str:
    """The workers the router lists that were not expected, as a note (empty when none)."""
    others = sorted(
        str(listed.get("url"))
        for listed in workers
        if not any(same_worker(listed.get("url"), worker.url) for worker in expected)
    )
    return f"; also registered: {', '.join(others)}" if others else ""
