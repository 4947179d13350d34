"""``python -m miles_sglang_plugin.serving.router_main --spec-json '<json>'``: run the router of one model.

The spec is a :class:`~miles_sglang_plugin.rendering.router_specs.RouterLaunchSpec` as JSON (``RouterLaunchSpec.to_json``);
the API key, when the spec says there is one, comes from the environment variable ``MSP_ROUTER_API_KEY``
(never argv). Build the command with :func:`miles_sglang_plugin.serving.routers.router_command`.

The router runs on the gateway the spec names (``settings.gateway``: ``sglang_router`` or ``smg``; ``auto`` is
decided here as at rendering) through its Python API (``Router.from_args(RouterArgs(...)).start()`` of
``sglang_router`` or ``smg``), not the CLI, because sglang-router 0.3.2 accepts ``consistent_hashing`` only
there. It starts with the workers of ``--workers-json`` (a JSON list of ``{"url", "worker_type",
"bootstrap_port"}``; none at the first start, when engines are added through ``POST /workers`` as they come
up): a router restarted while serving starts with the engines that serve, so that it never answers 503 for
want of workers. Both gateways handle SIGTERM the same way (below).

Shutdown: the Rust router handles SIGTERM (and SIGINT) itself: it logs "Received terminate signal, starting
graceful shutdown", stops accepting connections, waits for in-flight requests (at most
``shutdown_grace_period_secs``, 180 s by default), and ``start()`` returns; this module then exits 0 (130
after SIGINT). ``start()`` holds the GIL while it runs, so no Python code (signal handlers, threads) runs
meanwhile.

Exit codes: 0 after a normal shutdown, 2 for a bad spec or settings, 1 when the router fails to start (for
example a port already in use), 130 after SIGINT.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from miles_sglang_plugin.rendering.router_specs import (
    RouterLaunchSpec,
    WorkerRegistration,
    gateway_info,
    gateway_version,
    validate_router_settings,
)
from miles_sglang_plugin.serving.routers import API_KEY_ENV

_TAG = "[miles_sglang_plugin.serving.router_main]"


def _fail(code: int, message: str) -> int:
    print(f"{_TAG} {message}", file=sys.stderr, flush=True)
    return code


def build_router_args_kwargs(
    spec: RouterLaunchSpec, workers: Sequence[WorkerRegistration] = ()
) -> dict[str, Any]:
    """The ``RouterArgs`` keyword arguments for ``spec`` with ``workers`` given at start (the key only if the
    spec has one)."""
    kwargs = spec.settings.router_args_kwargs()
    regular = [w.url for w in workers if w.worker_type == "regular"]
    prefill = [(w.url, w.bootstrap_port) for w in workers if w.worker_type == "prefill"]
    decode = [w.url for w in workers if w.worker_type == "decode"]
    kwargs.update(
        host=spec.host,
        port=spec.port,
        prometheus_host=spec.host,  # metrics bind where the router binds (loopback stays loopback)
        prometheus_port=spec.prometheus_port,
        pd_disaggregation=spec.pd_disaggregation,
        worker_urls=regular,
        prefill_urls=prefill,
        decode_urls=decode,
        api_key=spec.api_key,
    )
    return kwargs


class _StartError(Exception):
    """The router cannot start: the exit code and the message to print."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m miles_sglang_plugin.serving.router_main",
        description="Run one model's router (sglang-router or SMG, Python API) from a RouterLaunchSpec JSON. "
        f"The API key, if any, is read from ${API_KEY_ENV}.",
    )
    parser.add_argument("--spec-json", required=True, help="RouterLaunchSpec.to_json() output")
    parser.add_argument(
        "--workers-json", default="[]", help="workers to start with: [{url, worker_type, bootstrap_port}]"
    )
    return parser


def _workers_from_json(text: str) -> list[WorkerRegistration]:
    try:
        raw = json.loads(text)
        if not isinstance(raw, list):
            raise ValueError("not a list")
        return [WorkerRegistration(**entry) for entry in raw]
    except (ValueError, TypeError) as e:
        raise _StartError(2, f"--workers-json is not a list of workers: {e}") from None


def _spec_from_json(spec_json: str) -> RouterLaunchSpec:
    """The spec with its API key (taken out of the environment), its settings checked."""
    try:
        raw = json.loads(spec_json)
        key_in_env = bool(raw.get("api_key_in_env", False)) if isinstance(raw, dict) else False
    except ValueError as e:
        raise _StartError(2, f"--spec-json is not valid JSON: {e}") from None
    api_key = os.environ.pop(API_KEY_ENV, None)  # not inherited by anything this process might start
    if key_in_env and not api_key:
        raise _StartError(2, f"the spec says the router has an API key, but ${API_KEY_ENV} is empty or unset")
    if not key_in_env:
        api_key = None  # ignore a stray variable inherited from the environment
    try:
        spec = RouterLaunchSpec.from_json(spec_json, api_key=api_key)
    except (ValueError, TypeError) as e:
        raise _StartError(2, f"bad router spec: {e}") from None
    problems = validate_router_settings(spec.settings)
    if problems:
        raise _StartError(2, f"bad router settings for model {spec.model!r}:\n  - " + "\n  - ".join(problems))
    return dataclasses.replace(spec, settings=spec.settings.resolved())


def _smg_router(router_module: Any, router_args: Any, drain_settle_secs: int) -> Any:
    """SMG's ``Router.from_args`` with the Rust router's ``drain_settle_secs`` (an argument of its constructor,
    ``smg.router._Router``, that ``RouterArgs`` does not carry). Where this SMG's router takes no such
    argument, its own default stays, which the router's log says."""
    rust = getattr(router_module, "_Router", None)
    if rust is None or "drain_settle_secs" not in (getattr(rust, "__text_signature__", None) or ""):
        print(f"{_TAG} this SMG takes no drain_settle_secs: its own drain time stays", flush=True)
        return router_module.Router.from_args(router_args)
    router_module._Router = functools.partial(rust, drain_settle_secs=drain_settle_secs)
    try:
        return router_module.Router.from_args(router_args)
    finally:
        router_module._Router = rust


def _build_router(spec: RouterLaunchSpec, workers: Sequence[WorkerRegistration] = ()) -> Any:
    gateway = gateway_info(spec.settings.gateway)
    router_module = importlib.import_module(f"{gateway.module}.router")
    args_module = importlib.import_module(f"{gateway.module}.router_args")
    try:
        router_args = args_module.RouterArgs(**build_router_args_kwargs(spec, workers))
        router_args._validate_router_args()
        if gateway.name == "smg":
            return _smg_router(router_module, router_args, spec.settings.drain_settle_secs)
        return router_module.Router.from_args(router_args)
    except Exception as e:
        raise _StartError(
            2,
            f"{gateway.distribution} rejected the settings for model {spec.model!r}: {type(e).__name__}: {e}",
        ) from None


def _policy_description(spec: RouterLaunchSpec) -> str:
    settings = spec.settings
    policy = settings.policy
    if spec.pd_disaggregation and (settings.prefill_policy or settings.decode_policy):
        prefill = settings.prefill_policy or settings.policy
        decode = settings.decode_policy or settings.policy
        policy += f" (prefill={prefill}, decode={decode})"
    return policy


def _serve(router: Any, spec: RouterLaunchSpec) -> int:
    """Run the router until it is told to stop; the exit code."""
    try:
        router.start()  # blocks until SIGTERM/SIGINT; holds the GIL meanwhile
    except KeyboardInterrupt:
        return 130
    except BaseException as e:  # pyo3 PanicException derives from BaseException
        if isinstance(e, SystemExit):
            raise
        return _fail(
            1,
            f"router for model {spec.model!r} on {spec.url} (metrics port {spec.prometheus_port}) "
            f"failed: {type(e).__name__}: {e}",
        )
    print(f"{_TAG} router for model {spec.model!r} at {spec.url} stopped", flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        spec = _spec_from_json(args.spec_json)
        workers = _workers_from_json(args.workers_json)
        router = _build_router(spec, workers)
    except _StartError as e:
        return _fail(e.code, str(e))
    gateway = spec.settings.gateway
    print(
        f"{_TAG} router for model {spec.model!r} at {spec.url} policy={_policy_description(spec)} "
        f"pd={spec.pd_disaggregation} metrics=:{spec.prometheus_port} "
        f"gateway={gateway_info(gateway).distribution} {gateway_version(gateway)} pid={os.getpid()}",
        flush=True,
    )
    return _serve(router, spec)


if __name__ == "__main__":
    sys.exit(main())
