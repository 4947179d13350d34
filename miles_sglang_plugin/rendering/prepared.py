"""A resolved plan together with its launch specs: what ``plan --json`` prints and what a launcher starts."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TextIO

from miles_sglang_plugin.config.schema import EngineKind, SGLangDeployConf
from miles_sglang_plugin.errors import DeploymentConfigError, ProblemCollector
from miles_sglang_plugin.planning.plan import DeploymentPlan, EnginePlan
from miles_sglang_plugin.rendering.launch_specs import LaunchSpecs, check_deploy_settings, render_launch
from miles_sglang_plugin.rendering.lora import LoraPreload, lora_preload, lora_problems
from miles_sglang_plugin.rendering.ports import (
    HostNotUsableError,
    NodePortFinder,
    PortAssignment,
    PortClaims,
    PortExhaustedError,
    assign_ports,
)
from miles_sglang_plugin.rendering.server_arg_checks import server_arg_value_problems


@dataclass(frozen=True)
class PreparedDeployment:
    plan: DeploymentPlan
    settings: SGLangDeployConf
    launch: LaunchSpecs
    #: The ports every engine process and router got (what a change of the running deployment keeps).
    ports: PortAssignment | None = None

    def to_dict(self) -> dict[str, Any]:
        """The plan's JSON with, per engine, its processes' argv/env/url and, per model, its router."""
        data = self.plan.to_dict()
        for model in self.plan.models:
            model_dict = data["models"][model.name]
            if model.has_router:
                model_dict["router"] = self.launch.router(model.name).to_dict()
            for group in model.groups:
                for engine_dict in model_dict["groups"][group.name]["engines"]:
                    engine_dict["launch"] = [
                        process.to_dict() for process in self.launch.for_engine(engine_dict["id"])
                    ]
        data["engine_kind"] = self.launch.engine_kind.value
        data["notes"] = [*data["notes"], *self.launch.notes]
        return data

    def write_json(self, out: TextIO, **extra: Any) -> None:
        """:meth:`to_dict` (with ``extra`` keys at the end) as JSON to ``out``, written as it is made: the
        plan's engines and a router's workers one compact object per line, every object above them spread
        over lines. The same document as ``json.dumps(to_dict())``; for a plan of 65,536 engines, made one
        engine at a time (no whole dictionary of the plan, no pure-Python indented encoder)."""
        for chunk in _json_chunks(self._lazy_dict(extra), ""):
            out.write(chunk)
        out.write("\n")

    def _lazy_dict(self, extra: Mapping[str, Any]) -> dict[str, Any]:
        """:meth:`to_dict` with each group's engines and each router's workers as lazy arrays."""
        plan = self.plan
        bare = replace(
            plan,
            models=tuple(
                replace(m, groups=tuple(replace(g, engines=()) for g in m.groups)) for m in plan.models
            ),
        )
        data = bare.to_dict()
        data["nodes"] = list(plan.nodes)
        for model in plan.models:
            model_dict = data["models"][model.name]
            for group in model.groups:
                model_dict["groups"][group.name]["engines"] = _LazyArray(
                    self._engine_lines(group.engines), encoded=True
                )
            if model.has_router:
                router = self.launch.router(model.name)
                model_dict["router"] = {
                    **router.to_dict(workers=False),
                    "workers": _LazyArray(router.worker_dicts),
                }
        data["engine_kind"] = self.launch.engine_kind.value
        data["notes"] = [*data["notes"], *self.launch.notes]
        data.update(extra)
        return data

    def _engine_lines(self, engines: Sequence[EnginePlan]) -> Callable[[], Iterator[str]]:
        """Each engine's entry of :meth:`to_dict` as ``json.dumps`` writes it: encoded with a slot for each
        process's command line and environment, filled with their JSON from parts their template encoded once
        (a plan of 65,536 engines shares a few templates)."""

        def each() -> Iterator[str]:
            for engine in engines:
                processes = self.launch.for_engine(engine.id)
                entry = engine.to_dict()
                entry["launch"] = [process.to_dict_with(_SLOT, _SLOT) for process in processes]
                pieces = json.dumps(entry).split(_SLOT_JSON)
                if len(pieces) != 2 * len(processes) + 1:  # a value of the plan holds the slot's NUL itself
                    entry["launch"] = [process.to_dict() for process in processes]
                    yield json.dumps(entry)
                    continue
                line = [pieces[0]]
                for i, process in enumerate(processes):
                    line += (process.argv_json(), pieces[2 * i + 1], process.env_json(), pieces[2 * i + 2])
                yield "".join(line)

        return each


#: Where a process's command line and environment go in its engine's encoded line: NUL, which no argument or
#: environment variable can hold.
_SLOT = "\0"
_SLOT_JSON = json.dumps(_SLOT)


class _LazyArray:
    """A JSON array whose items are made when it is written (:func:`_json_chunks`): values, or (``encoded``)
    each item's JSON text."""

    def __init__(self, items: Callable[[], Iterator[Any]], encoded: bool = False) -> None:
        self.items = items
        self.encoded = encoded


def _json_chunks(value: Any, indent: str) -> Iterator[str]:
    """``value`` as JSON text: objects one key per line, arrays of objects or arrays one item per line (each
    item on one line, by the C encoder), arrays of plain values on one line."""
    if isinstance(value, dict) and value:
        inner = indent + "  "
        yield "{"
        for i, (key, item) in enumerate(value.items()):
            yield f"{',' if i else ''}\n{inner}{json.dumps(key)}: "
            yield from _json_chunks(item, inner)
        yield f"\n{indent}}}"
    elif isinstance(value, _LazyArray):
        items = value.items()
        yield from _array_lines(items if value.encoded else map(json.dumps, items), indent)
    elif isinstance(value, list) and any(isinstance(item, dict | list) for item in value):
        yield from _array_lines(map(json.dumps, value), indent)
    else:
        yield json.dumps(value)


def _array_lines(lines: Iterator[str], indent: str) -> Iterator[str]:
    """An array from its items' JSON text, one item per line."""
    first = next(lines, None)
    if first is None:
        yield "[]"
        return
    inner = indent + "  "
    between = f",\n{inner}"
    yield f"[\n{inner}{first}"
    while batch := list(itertools.islice(lines, 512)):  # written 512 lines at a time
        yield between + between.join(batch)
    yield f"\n{indent}]"


def _checked_lora(
    plan: DeploymentPlan, settings: SGLangDeployConf, problems: ProblemCollector
) -> LoraPreload:
    """The LoRA settings checked, and the adapters the engines preload (raises with every problem so far)."""
    problems.extend(lora_problems(settings.lora, colocate=plan.trainer.colocate))
    problems.raise_if_any()
    preload = lora_preload(settings.lora, rollout_only=plan.trainer.debug_rollout_only)
    problems.extend(preload.problems)
    problems.raise_if_any()
    return preload


def _ports(
    plan: DeploymentPlan, settings: SGLangDeployConf, problems: ProblemCollector, **how: Any
) -> PortAssignment:
    """The deployment's ports (:func:`assign_ports` with ``how``); a host or port range that cannot give them
    is a problem under the key that sets it."""
    try:
        return assign_ports(
            plan, port_base=settings.launch.port_base, port_max=settings.launch.port_max, **how
        )
    except HostNotUsableError as exc:
        problems.add("sglang_deploy.launch.host", str(exc))
    except PortExhaustedError as exc:
        problems.add("sglang_deploy.launch.port_base", str(exc))
    problems.raise_if_any()
    raise AssertionError("unreachable: a problem was added")


def prepare_deployment(
    plan: DeploymentPlan,
    settings: SGLangDeployConf,
    *,
    server_arg_fields: Collection[str] | None = None,
    probe: bool = False,
    claims: PortClaims | None = None,
    host_of_node: Callable[[int], str] | None = None,
    router_host: str | None = None,
    find_node_ports: NodePortFinder | None = None,
    fixed_ports: PortAssignment | None = None,
    launcher_env: Mapping[str, str] | None = None,
) -> PreparedDeployment:
    """Check the deployment-wide settings, assign ports and render every launch spec.

    By default every node of the plan and the routers map to ``settings.launch.host`` (one machine: the local
    backend runs a multi-node plan side by side only with stand-ins); a backend whose nodes are other machines
    passes each node's address (``host_of_node``), the routers' (``router_host``) and, to find engine ports on
    the nodes themselves, ``find_node_ports``. ``fixed_ports``: the ports of processes and routers that keep
    running through a change of the deployment (theirs, and nobody else's). ``launcher_env``: the environment
    whose values of Miles' engine variables win over Miles' defaults (None: this process's). Which LoRA
    adapters the engines preload is decided here, looking at their directories once
    (:func:`~miles_sglang_plugin.rendering.lora.lora_preload`)."""
    problems = ProblemCollector("sglang_deploy")
    problems.extend(check_deploy_settings(settings, server_arg_fields))
    preload = _checked_lora(plan, settings, problems)
    host = settings.launch.host
    node_host = host_of_node or (lambda _node: host)
    routers_on = router_host if router_host is not None else host
    ports = _ports(
        plan,
        settings,
        problems,
        host_of_node=node_host,
        router_host=routers_on,
        probe=probe,
        claims=claims,
        find_node_ports=find_node_ports,
        fixed=fixed_ports,
    )
    launch = render_launch(
        plan,
        settings,
        ports,
        host_of_node=node_host,
        router_host=routers_on,
        server_arg_fields=server_arg_fields,
        launcher_env=launcher_env,
        lora_paths=preload.paths,
    )
    if preload.notes:
        launch = replace(launch, notes=(*preload.notes, *launch.notes))
    real_launch = probe and launch.engine_kind is not EngineKind.simulated
    problems.extend(
        server_arg_value_problems(plan, settings, launch.engines, launching_real_engines=real_launch)
    )
    problems.raise_if_any()
    return PreparedDeployment(plan=plan, settings=settings, launch=launch, ports=ports)


__all__ = ["DeploymentConfigError", "PreparedDeployment", "prepare_deployment"]
