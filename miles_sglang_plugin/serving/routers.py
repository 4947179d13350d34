"""The HTTP side of a model's router: the command that starts it, worker registration, readiness, removal.

Small synchronous helpers over the control API that sglang-router and SMG share; the router's settings and
launch spec are :mod:`miles_sglang_plugin.rendering.router_specs`. What sglang-router 0.3.2 does on the wire
(checked against the real router; SMG 1.13.0's differences after the list):

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
  while that URL's registration is still in progress), so a worker is re-registered by :func:`replace_worker`.
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
import time
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import httpx

from miles_sglang_plugin.rendering.router_specs import RouterLaunchSpec, WorkerRegistration
from miles_sglang_plugin.serving import quiet_http

__all__ = [
    "API_KEY_ENV",
    "RouterRequestError",
    "deregister_workers",
    "register_workers",
    "remove_worker",
    "replace_worker",
    "router_command",
    "router_ready",
    "router_workers",
    "wait_router_ready",
]

#: The router process reads its API key from here (never from argv, which ``ps`` shows to every user).
API_KEY_ENV = "MSP_ROUTER_API_KEY"
ROUTER_MAIN_MODULE = "miles_sglang_plugin.serving.router_main"

_HTTP_TIMEOUT_S = 10.0


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
# HTTP helpers
# ----------------------------------------------------------------------------------------------------
class RouterRequestError(RuntimeError):
    """A router control-plane call failed (connection error or non-2xx answer)."""

    def __init__(self, message: str, status_code: int | None = None, body: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _base(router_url: str) -> str:
    return router_url.rstrip("/")


#: The most a router's answer may hold.
_MAX_ANSWER_BYTES = 16 * 1024 * 1024


def _request(
    method: str,
    url: str,
    *,
    api_key: str | None,
    timeout_s: float,
    json_body: Any = None,
    ok: Callable[[int], bool] = lambda status: 200 <= status < 300,
) -> httpx.Response:
    """One call, its whole answer read within ``timeout_s`` (checked between chunks: a peer that drips
    bytes is cut off) and at most :data:`_MAX_ANSWER_BYTES`."""
    quiet_http.install()
    deadline = time.monotonic() + timeout_s
    try:
        with httpx.stream(method, url, json=json_body, headers=_headers(api_key), timeout=timeout_s) as resp:
            chunks, size = [], 0
            for chunk in resp.iter_raw():
                size += len(chunk)
                if size > _MAX_ANSWER_BYTES or time.monotonic() > deadline:
                    why = "is too large" if size > _MAX_ANSWER_BYTES else f"took over {timeout_s:g} s"
                    raise RouterRequestError(f"{method} {url}: its answer {why}")
                chunks.append(chunk)
            body = b"".join(chunks)
            resp = httpx.Response(resp.status_code, headers=resp.headers, content=body, request=resp.request)
    except httpx.HTTPError as e:
        raise RouterRequestError(f"{method} {url} failed: {type(e).__name__}: {e}") from e
    if not ok(resp.status_code):
        text = resp.text
        shown = text if len(text) <= 2000 else text[:2000] + "…"
        hint = " (the router has an API key: pass api_key)" if resp.status_code == 401 and not api_key else ""
        raise RouterRequestError(
            f"{method} {url} answered {resp.status_code}{hint}: {shown or '<empty body>'}",
            status_code=resp.status_code,
            body=text,
        )
    return resp


def _post_worker(
    base: str, worker: WorkerRegistration, api_key: str | None, worker_api_key: str | None, timeout_s: float
) -> dict[str, Any]:
    """One ``POST /workers``; the router's answer (RouterRequestError for a non-2xx one, 409 included)."""
    if not isinstance(worker, WorkerRegistration):
        raise TypeError(f"expected WorkerRegistration, got {type(worker).__name__}")
    body = worker.payload(worker_api_key if worker_api_key is not None else api_key)
    resp = _request("POST", f"{base}/workers", api_key=api_key, timeout_s=timeout_s, json_body=body)
    try:
        answer: dict[str, Any] = resp.json()
    except ValueError:
        return {"status": resp.status_code, "body": resp.text}
    return answer


def register_workers(
    router_url: str,
    workers: Iterable[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = _HTTP_TIMEOUT_S,
    *,
    worker_api_key: str | None = None,
    replace: bool = False,
) -> list[dict[str, Any]]:
    """``POST {router_url}/workers`` for each worker; returns the router's answers (``worker_id`` etc.).

    ``api_key`` authenticates to the router (``Authorization: Bearer``) and is also sent as the worker's
    ``api_key`` unless ``worker_api_key`` is given. The router adds workers in the background (202): use
    :func:`router_ready` / :func:`wait_router_ready` to know when they are in.

    A URL the router holds already: SMG answers 409 ``WORKER_ALREADY_EXISTS``, and the worker is then
    registered afresh by :func:`replace_worker` (so that re-registering a restarted engine works with either
    gateway); sglang-router 0.3.2 accepts the POST and keeps its entry as it was. ``replace=True`` goes
    through :func:`replace_worker` for every worker, so that either gateway ends with exactly the given
    registrations. Raises RouterRequestError.
    """
    base = _base(router_url)
    answers = []
    for worker in workers:
        kwargs: dict[str, Any] = dict(api_key=api_key, worker_api_key=worker_api_key)
        if replace:
            answers.append(replace_worker(base, worker, timeout_s=max(timeout_s, 30.0), **kwargs))
            continue
        try:
            answers.append(_post_worker(base, worker, api_key, worker_api_key, timeout_s))
        except RouterRequestError as exc:
            if not _already_registered(exc):
                raise
            answers.append(replace_worker(base, worker, timeout_s=max(timeout_s, 30.0), **kwargs))
    return answers


def _already_registered(exc: RouterRequestError) -> bool:
    """SMG's answer to a POST of a URL it holds: 409 with ``"code": "WORKER_ALREADY_EXISTS"``."""
    if exc.status_code != 409:
        return False
    try:
        data = json.loads(exc.body or "")
    except ValueError:
        return False
    return isinstance(data, dict) and data.get("code") == "WORKER_ALREADY_EXISTS"


def _entries_of(base: str, url: str, api_key: str | None, timeout_s: float) -> list[dict[str, Any]]:
    """The router's entries of the worker at ``url`` that have an id (dp-aware: one per rank)."""
    return [
        entry
        for entry in router_workers(base, api_key=api_key, timeout_s=timeout_s)
        if same_worker(entry.get("url"), url) and entry.get("id")
    ]


def _delete_entries(base: str, entries: list[dict[str, Any]], api_key: str | None, timeout_s: float) -> None:
    for entry in entries:
        _request(
            "DELETE",
            f"{base}/workers/{entry['id']}",
            api_key=api_key,
            timeout_s=timeout_s,
            ok=lambda status: 200 <= status < 300 or status == 404,  # already gone is fine
        )


def replace_worker(
    router_url: str,
    worker: WorkerRegistration,
    api_key: str | None = None,
    timeout_s: float = 30.0,
    *,
    worker_api_key: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Register ``worker`` afresh, whether or not the router holds its URL already (an engine restarted on
    its URL, an external engine that came back, a router being re-populated): the router's entries of that
    URL are removed (``DELETE /workers/{id}``), and once it lists none the worker is POSTed; a 409 (SMG: the
    removal is still draining, or another registration of the URL raced this one) removes what is listed and
    tries again, until ``timeout_s``. Returns the router's answer to the POST that was accepted.

    With both gateways this leaves one entry with this registration's type, bootstrap port and labels (a
    second POST alone would be refused by SMG and ignored by sglang-router). Raises RouterRequestError (the
    last 409 when the URL never became free, naming the entries left) or what the router answered otherwise.
    sglang-router 0.3.2 cannot remove the entries of a dp-aware worker (see the module's notes): its old
    entries then stay listed and this raises after ``timeout_s``.
    """
    base = _base(router_url)
    deadline = clock() + timeout_s
    call_s = min(_HTTP_TIMEOUT_S, timeout_s)
    while True:
        entries = _entries_of(base, worker.url, api_key, call_s)
        _delete_entries(base, entries, api_key, call_s)
        while entries and clock() < deadline:
            sleep(0.05)
            entries = _entries_of(base, worker.url, api_key, call_s)
        if not entries:
            try:
                return _post_worker(base, worker, api_key, worker_api_key, call_s)
            except RouterRequestError as exc:
                if exc.status_code != 409 or clock() >= deadline:
                    raise
                sleep(0.05)
                continue
        listed = ", ".join(f"{entry.get('url')} (id {entry.get('id')})" for entry in entries)
        raise RouterRequestError(
            f"router at {base} still lists {listed} {timeout_s:g}s after DELETE: cannot register "
            f"{worker.describe()} again",
            status_code=409,
        )


def router_workers(
    router_url: str, api_key: str | None = None, timeout_s: float = _HTTP_TIMEOUT_S
) -> list[dict[str, Any]]:
    """The ``workers`` list of ``GET {router_url}/workers`` (only workers whose registration completed)."""
    resp = _request("GET", f"{_base(router_url)}/workers", api_key=api_key, timeout_s=timeout_s)
    try:
        data = resp.json()
    except ValueError as e:
        raise RouterRequestError(f"GET {router_url}/workers: not JSON: {resp.text[:500]}") from e
    workers = data.get("workers") if isinstance(data, dict) else None
    if not isinstance(workers, list):
        raise RouterRequestError(f"GET {router_url}/workers: unexpected answer {str(data)[:500]}")
    return workers


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


def _readiness(base: str, api_key: str | None, timeout_s: float) -> tuple[bool, str]:
    """``GET /readiness``: (answered 200, what it says)."""
    try:
        resp = _request(
            "GET", f"{base}/readiness", api_key=api_key, timeout_s=timeout_s, ok=lambda status: True
        )
    except RouterRequestError as e:
        return False, f"unreachable ({e})"
    ready = resp.status_code == 200
    try:
        data = resp.json()
        readiness = (
            f"{data.get('healthy_workers')}/{data.get('total_workers')} workers healthy"
            if ready
            else f"not ready ({data.get('reason', resp.text)})"
        )
    except (ValueError, AttributeError):
        readiness = f"HTTP {resp.status_code}: {resp.text[:200]}"
    return ready, readiness


def others_note(workers: list[dict[str, Any]], expected: Collection[WorkerRegistration]) -> str:
    """The workers the router lists that were not expected, as a note (empty when none)."""
    others = sorted(
        str(listed.get("url"))
        for listed in workers
        if not any(same_worker(listed.get("url"), worker.url) for worker in expected)
    )
    return f"; also registered: {', '.join(others)}" if others else ""


def router_ready(
    router_url: str,
    expected: Collection[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = 5.0,
) -> tuple[bool, str]:
    """``(ready, detail)``: ready when every expected worker is listed by ``GET /workers`` with its
    worker_type (and bootstrap_port) and ``is_healthy``, and ``GET /readiness`` answers 200.

    ``detail`` says what is missing (or, when ready, how many workers are healthy). Never raises for a router
    that is down or not answering: that is reported as not ready.
    """
    base = _base(router_url)
    try:
        workers = router_workers(base, api_key=api_key, timeout_s=timeout_s)
    except RouterRequestError as e:
        if e.status_code is None:
            return False, f"router at {base} not reachable: {e}"
        return False, f"router at {base}: {e}"

    problems = registration_problems(workers, expected)
    ready, readiness = _readiness(base, api_key, timeout_s)
    note = others_note(workers, expected)
    if problems:
        listed = "; ".join(message for messages in problems.values() for message in messages)
        expected_urls = len({worker.url for worker in expected})
        return False, f"waiting for {len(problems)} of {expected_urls} workers: {listed}{note}"
    if not ready:
        return False, f"all {len(expected)} expected workers registered, but /readiness: {readiness}{note}"
    return True, f"ready: {readiness}{note}"


def wait_router_ready(
    router_url: str,
    expected: Collection[WorkerRegistration],
    api_key: str | None = None,
    timeout_s: float = 60.0,
    interval_s: float = 0.1,
    alive: Callable[[], bool] | None = None,
) -> str:
    """Poll :func:`router_ready` until True; returns its detail. Raises TimeoutError with the last detail, or
    RuntimeError as soon as ``alive()`` returns False (e.g. ``lambda: proc.poll() is None``)."""
    deadline = time.monotonic() + timeout_s
    detail = "not checked yet"
    while True:
        if alive is not None and not alive():
            raise RuntimeError(f"router at {router_url} exited before it was ready (last state: {detail})")
        ok, detail = router_ready(router_url, expected, api_key=api_key, timeout_s=min(5.0, timeout_s))
        if ok:
            return detail
        if time.monotonic() >= deadline:
            raise TimeoutError(f"router at {router_url} not ready after {timeout_s:g}s: {detail}")
        time.sleep(interval_s)


def deregister_workers(
    router_url: str,
    api_key: str | None = None,
    timeout_s: float = _HTTP_TIMEOUT_S,
    wait: bool = True,
) -> list[str]:
    """Remove every worker the router lists (``GET /workers``, then ``DELETE /workers/{id}``).

    Removal is queued by the router (202); with ``wait`` this polls until the list no longer shows them (up
    to ``timeout_s``). Returns the removed URLs. A registration still in progress (not yet listed) is not
    affected.
    """
    base = _base(router_url)
    workers = router_workers(base, api_key=api_key, timeout_s=timeout_s)
    removed = []
    ids = set()
    for worker in workers:
        worker_id = worker.get("id")
        if not worker_id:
            continue
        _request(
            "DELETE",
            f"{base}/workers/{worker_id}",
            api_key=api_key,
            timeout_s=timeout_s,
            ok=lambda status: 200 <= status < 300 or status == 404,  # already gone is fine
        )
        ids.add(worker_id)
        removed.append(str(worker.get("url")))
    if wait and ids:
        deadline = time.monotonic() + timeout_s
        while True:
            left = [
                worker
                for worker in router_workers(base, api_key=api_key, timeout_s=timeout_s)
                if worker.get("id") in ids
            ]
            if not left:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"router at {base} still lists {', '.join(str(worker.get('url')) for worker in left)} "
                    f"{timeout_s:g}s after DELETE"
                )
            time.sleep(0.05)
    return removed


def remove_worker(
    router_url: str, url: str, api_key: str | None = None, timeout_s: float = _HTTP_TIMEOUT_S
) -> int:
    """Take the worker at ``url`` out of the router (every entry of it: dp-aware routers list one per rank);
    returns how many entries were removed (0: it was not listed). Removal is queued by the router (202): SMG
    stops routing to it at once and lists it for its drain settle time more; :func:`replace_worker` waits for
    that before it registers the URL again."""
    base = _base(router_url)
    entries = _entries_of(base, url, api_key, timeout_s)
    _delete_entries(base, entries, api_key, timeout_s)
    return len(entries)
