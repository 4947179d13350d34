"""Render: the exact command line and environment of every engine process and router, as pure data.

``render_launch(plan, settings, ports, ...)`` turns a resolved plan into :class:`LaunchSpecs`; every backend
(the local subprocess launcher now, a distributed one later) starts exactly these. ServerArgs values follow
Miles' ``_compute_server_args``, with this precedence (highest first):

1. the group's ``overrides`` (from the plan; plan-owned keys were refused at resolution);
2. values derived from the plan (ports, TP size, node rank, disaggregation mode, memory saver, seed, ...);
3. deployment-wide defaults, ``sglang_deploy.server_defaults`` (Miles' ``--sglang-*`` flags).

Values Miles derives for fields that the installed SGLang does not have (e.g. ``prefill_round_robin_balance``
in SGLang 0.5.23) are left out and noted, never sent to an engine that would reject them.
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import sys
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from json.encoder import encode_basestring_ascii as encode_json_string  # json.dumps' own, for a str
from typing import Any

from miles_sglang_plugin.addresses import host_port, http_base_url
from miles_sglang_plugin.config.deployment_spec import WorkerType, thaw
from miles_sglang_plugin.config.schema import EngineKind, SGLangDeployConf
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.engine_env import (
    CUSTOM_ALL_REDUCE_ENV,
    MILES_ENGINE_ENV,
    PACKAGE_ENV_NAMES,
    engine_env_defaults,
)
from miles_sglang_plugin.errors import Problem
from miles_sglang_plugin.masking import mask_argv, mask_env
from miles_sglang_plugin.planning.plan import (
    DeploymentPlan,
    EnginePlan,
    EngineProcessPlan,
    ExternalEnginePlan,
    GroupPlan,
    ModelPlan,
)
from miles_sglang_plugin.planning.resolution import PLAN_OWNED_OVERRIDES, suggest
from miles_sglang_plugin.printable import shell_join, shell_quote
from miles_sglang_plugin.rendering.cpu_engine import (
    cpu_engine_env,
    cpu_notes,
    cpu_server_args,
)
from miles_sglang_plugin.rendering.deploy_checks import deploy_setting_problems
from miles_sglang_plugin.rendering.lora import lora_server_args
from miles_sglang_plugin.rendering.ports import PortAssignment
from miles_sglang_plugin.rendering.router_specs import (
    RouterLaunchSpec,
    RouterSettings,
    WorkerRegistration,
    validate_router_settings,
    worker_labels,
)

STANDIN_COMMAND = ("{python}", "-m", "miles_sglang_plugin.standin")

#: server_defaults may not set what the plan decides (beyond the keys a group override may not set either).
PLAN_OWNED_DEFAULTS: Mapping[str, str] = {
    **PLAN_OWNED_OVERRIDES,
    "tp_size": "it is each group's num_gpus_per_engine",
    "model_path": "it is each model's model_path (or hf_checkpoint)",
    "disaggregation_mode": "it follows each group's worker_type",
    "random_seed": "each engine gets the trainer's seed + its rank",
    "enable_memory_saver": "it follows offload_rollout and each group's offload decision",
    "trust_remote_code": "always on, as in Miles",
    "skip_server_warmup": "always on, as in Miles",
    "enable_return_routed_experts": "it follows use_rollout_routing_replay",
    "enable_return_indexer_topk": "it follows use_rollout_indexer_replay",
    "engine_info_bootstrap_port": "assigned per engine so that none collide",
}


@functools.cache
def _flag(field: str) -> str:
    """The command line flag of a ServerArgs field."""
    return "--" + field.replace("_", "-")


def server_args_to_argv(values: Mapping[str, Any]) -> list[str]:
    """ServerArgs field -> value as ``launch_server`` flags: ``True`` is a bare flag, ``False``/``None`` are
    left out, lists become several values, mappings become JSON. A single value that starts with ``-`` (an API
    key ``--x``, a negative number) is written ``--flag=value``, the one form argparse never reads as a flag."""
    argv: list[str] = []
    for key, value in values.items():
        flag = "--" + key.replace("_", "-")
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv.append(flag)
            argv.extend(str(v) for v in value)
        else:
            text = json.dumps(thaw(value)) if isinstance(value, Mapping) else str(value)
            argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return argv


#: ServerArgs fields whose values differ between the processes of one group (their node, ports, rank); every
#: other value of a group is the same for each of its processes, and is kept (and rendered) once.
PER_PROCESS_FIELDS = (
    "random_seed",
    "host",
    "port",
    "nccl_port",
    "dist_init_addr",
    "nnodes",
    "node_rank",
    "engine_info_bootstrap_port",
    "disaggregation_bootstrap_port",
)


@dataclass(frozen=True, eq=False)
class ProcessTemplate:
    """What every engine process of one group shares: the command prefix, the ServerArgs values in command
    line order (``own_keys``: those each process gives itself), the argv of the shared values, rendered once,
    and the environment but for the process's own part."""

    prefix: tuple[str, ...]
    values: Mapping[str, Any] = field(repr=False)
    own_keys: tuple[str, ...]
    #: Miles' engine variables (below the stand-in's faults) and what comes above them (``sglang_deploy.env``).
    env_head: Mapping[str, str] = field(repr=False)
    env_tail: Mapping[str, str] = field(repr=False)
    #: The deployment's settings, for the stand-in's fault variables (None: real engines, no faults).
    standin: SGLangDeployConf | None = field(default=None, repr=False)

    #: The command line as runs of fixed tokens (the prefix, the shared values) and own keys, in order; and
    #: the same with secret values masked, where masking the runs one by one is masking the whole command line
    #: (no run ends with a bare secret flag whose value would be the next one's), else None.
    segments: tuple[tuple[str, ...] | str, ...] = field(default=(), repr=False)
    masked_segments: tuple[tuple[str, ...] | str, ...] | None = field(default=None, repr=False)
    _masked_env: dict[str, str] | None = field(default=None, repr=False, init=False)
    #: :attr:`masked_segments` with each run of fixed tokens as JSON text (made on first use).
    _masked_json: tuple[str | tuple[str, str], ...] | None = field(default=None, repr=False, init=False)
    #: The masked environment of real engines as JSON text on either side of ``CUDA_VISIBLE_DEVICES``'s value.
    _env_json: tuple[str, str] | None = field(default=None, repr=False, init=False)

    @classmethod
    def of(
        cls,
        prefix: tuple[str, ...],
        values: Mapping[str, Any],
        own_keys: tuple[str, ...],
        env_head: Mapping[str, str],
        env_tail: Mapping[str, str],
        standin: SGLangDeployConf | None,
    ) -> ProcessTemplate:
        own = set(own_keys)
        own_keys = tuple(k for k in values if k in own)  # in the command line's order
        chunks = tuple(k if k in own else tuple(server_args_to_argv({k: v})) for k, v in values.items())
        runs = _runs(prefix, chunks)
        local = all(mask_argv([*run, "x"])[-1] == "x" for run in runs if not isinstance(run, str))
        masked = tuple(r if isinstance(r, str) else tuple(mask_argv(r)) for r in runs) if local else None
        return cls(prefix, dict(values), own_keys, dict(env_head), dict(env_tail), standin, runs, masked)

    def own_of(self, values: Mapping[str, Any]) -> tuple[Any, ...]:
        """A process's values of :attr:`own_keys`, from all of its own values (``values``)."""
        return tuple(values[k] for k in self.own_keys)

    def value(self, key: str, own: Mapping[str, Any]) -> Any:
        """The value of ``key`` for the process whose own values are ``own``."""
        return own[key] if key in self.own_keys else self.values.get(key)

    def server_args(self, own: tuple[Any, ...]) -> dict[str, Any]:
        values = dict(self.values)
        values.update(zip(self.own_keys, own, strict=True))  # every own key is in values: its place is kept
        return values

    def masked_argv(self, own: tuple[Any, ...]) -> list[str]:
        """:meth:`argv` with every secret value masked (as :func:`~miles_sglang_plugin.masking.mask_argv`
        does), from the runs masked once where that is the same."""
        if self.masked_segments is None:
            return mask_argv(self.argv(own))
        return _render(self.masked_segments, own)

    def masked_argv_json(self, own: tuple[Any, ...]) -> str:
        """``json.dumps(masked_argv(own))``, from the runs of fixed tokens encoded once (a plan's JSON)."""
        encoded = self._masked_json
        if encoded is None:
            if self.masked_segments is None:
                return json.dumps(self.masked_argv(own))
            encoded = tuple(
                (s, encode_json_string(_flag(s))) if isinstance(s, str) else json.dumps(list(s))[1:-1]
                for s in self.masked_segments
            )
            object.__setattr__(self, "_masked_json", encoded)
        parts: list[str] = []
        values = iter(own)
        for segment in encoded:
            if isinstance(segment, str):
                parts.append(segment)
                continue
            key, flag = segment
            value = next(values)
            kind = type(value)
            if kind is int and value >= 0:  # a port, a rank, a seed: digits, nothing to escape
                parts.append(f'{flag}, "{value}"')
            elif kind is str and not value.startswith("-"):
                parts.append(f"{flag}, {encode_json_string(value)}")
            else:
                parts += map(encode_json_string, _value_tokens(key, value))
        return f"[{', '.join(parts)}]"

    def masked_env_json(self, engine_id: str, visible_devices: str) -> str:
        """``json.dumps(masked_env(engine_id, visible_devices))``, for real engines from the rest of the
        environment encoded once."""
        if self.standin is not None:
            return json.dumps(self.masked_env(engine_id, visible_devices))
        encoded = self._env_json
        if encoded is None:
            # NUL: a value no environment variable can hold, to find where the GPU ids go
            field_text = '"CUDA_VISIBLE_DEVICES": "\\u0000"'
            before, found, after = json.dumps(self.masked_env(engine_id, "\0")).partition(field_text)
            assert found, "the masked environment holds CUDA_VISIBLE_DEVICES"
            encoded = (before + '"CUDA_VISIBLE_DEVICES": ', after)
            object.__setattr__(self, "_env_json", encoded)
        return f"{encoded[0]}{encode_json_string(visible_devices)}{encoded[1]}"

    def argv(self, own: tuple[Any, ...]) -> tuple[str, ...]:
        return tuple(_render(self.segments, own))

    def env(self, engine_id: str, visible_devices: str) -> dict[str, str]:
        """Miles' engine defaults < the stand-in's faults < ``sglang_deploy.env`` < ``CUDA_VISIBLE_DEVICES``."""
        faults = standin_fault_env(self.standin, engine_id) if self.standin is not None else {}
        return {**self.env_head, **faults, **self.env_tail, "CUDA_VISIBLE_DEVICES": visible_devices}

    def masked_env(self, engine_id: str, visible_devices: str) -> dict[str, str]:
        """:meth:`env` with every value but the package's own masked (a printed plan's); for real engines (no
        stand-in faults, the same for every process but its GPUs) masked once."""
        if self.standin is not None:
            return mask_env(self.env(engine_id, visible_devices), shown=PACKAGE_ENV_NAMES)
        masked_once = self._masked_env
        if masked_once is None:
            masked_once = mask_env(self.env(engine_id, ""), shown=PACKAGE_ENV_NAMES)
            object.__setattr__(self, "_masked_env", masked_once)
        masked = dict(masked_once)
        masked["CUDA_VISIBLE_DEVICES"] = visible_devices  # never masked (a package variable), in its place
        return masked


def _runs(
    prefix: tuple[str, ...], chunks: tuple[tuple[str, ...] | str, ...]
) -> tuple[tuple[str, ...] | str, ...]:
    """The prefix and the chunks with consecutive fixed tokens joined into one run."""
    runs: list[tuple[str, ...] | str] = []
    fixed: list[str] = list(prefix)
    for chunk in chunks:
        if isinstance(chunk, str):
            if fixed:
                runs.append(tuple(fixed))
                fixed = []
            runs.append(chunk)
        else:
            fixed += chunk
    if fixed:
        runs.append(tuple(fixed))
    return tuple(runs)


def _render(segments: tuple[tuple[str, ...] | str, ...], own: tuple[Any, ...]) -> list[str]:
    """A command line from its runs of fixed tokens and own values (in the own keys' order), each own value
    rendered as :func:`server_args_to_argv` renders it."""
    tokens: list[str] = []
    values = iter(own)
    for segment in segments:
        tokens += _value_tokens(segment, next(values)) if isinstance(segment, str) else segment
    return tokens


def _value_tokens(key: str, value: Any) -> list[str]:
    """The tokens of one own value, as :func:`server_args_to_argv` renders it."""
    text = str(value) if type(value) in (int, str) else None  # the plan's ports, seed, host
    if text is None:
        return server_args_to_argv({key: value})
    if text.startswith("-"):
        return [f"{_flag(key)}={text}"]
    return [_flag(key), text]


@dataclass(frozen=True, slots=True)
class EngineProcessLaunch:
    """One engine process: what to run, where, with which environment. Its argv, environment and ServerArgs
    values are made from its group's :class:`ProcessTemplate` and its own values when asked (a plan of
    65,536 engines keeps one template per group, not 65,536 command lines)."""

    engine_id: str
    model: str
    group: str
    worker_type: WorkerType
    node: int
    node_rank: int
    nnodes: int
    host: str
    port: int
    template: ProcessTemplate = field(repr=False, compare=False)
    #: Its values of the template's ``own_keys``, in that order.
    own: tuple[Any, ...] = field(repr=False)
    #: ``CUDA_VISIBLE_DEVICES``: its local GPU ids (the local backend maps them onto the GPUs it was given).
    visible_devices: str = ""
    bootstrap_port: int | None = None

    @property
    def argv(self) -> tuple[str, ...]:
        """May hold the API key: never in repr; show :meth:`display_command` / :meth:`to_dict` instead."""
        return self.template.argv(self.own)

    @property
    def env(self) -> dict[str, str]:
        return self.template.env(self.engine_id, self.visible_devices)

    @property
    def server_args(self) -> dict[str, Any]:
        return self.template.server_args(self.own)

    @property
    def name(self) -> str:
        return self.engine_id if self.nnodes == 1 else f"{self.engine_id}.node{self.node_rank}"

    @property
    def serves_http(self) -> bool:
        return self.node_rank == 0

    @property
    def url(self) -> str:
        return http_base_url(self.host, self.port)

    def display_command(self) -> str:
        return shell_join(self.template.masked_argv(self.own))

    def to_dict(self) -> dict[str, Any]:
        return self.to_dict_with(
            self.template.masked_argv(self.own),
            self.template.masked_env(self.engine_id, self.visible_devices),
        )

    def to_dict_with(self, argv: Any, env: Any) -> dict[str, Any]:
        """:meth:`to_dict` with ``argv`` and ``env`` in place of its masked command line and environment."""
        return {
            "name": self.name,
            "node": self.node,
            "node_rank": self.node_rank,
            "host": self.host,
            "port": self.port,
            "url": self.url if self.serves_http else None,
            "bootstrap_port": self.bootstrap_port,
            "argv": argv,
            "env": env,
        }

    def argv_json(self) -> str:
        """``to_dict()["argv"]`` as JSON text, from its template's parts encoded once."""
        return self.template.masked_argv_json(self.own)

    def env_json(self) -> str:
        """``to_dict()["env"]`` as JSON text, from its template's parts encoded once."""
        return self.template.masked_env_json(self.engine_id, self.visible_devices)


@dataclass(frozen=True)
class RouterLaunch:
    model: str
    spec: RouterLaunchSpec
    workers: tuple[WorkerRegistration, ...]

    def to_dict(self, *, workers: bool = True) -> dict[str, Any]:
        out: dict[str, Any] = {
            "url": self.spec.url,
            "prometheus_port": self.spec.prometheus_port,
            "pd_disaggregation": self.spec.pd_disaggregation,
            "gateway": self.spec.settings.gateway,
            "policy": self.spec.settings.policy,
            "dp_aware": bool(self.spec.settings.extra.get("dp_aware", False)),
        }
        if workers:
            out["workers"] = list(self.worker_dicts())
        return out

    def worker_dicts(self) -> Iterator[dict[str, Any]]:
        for w in self.workers:
            yield {
                "url": w.url,
                "worker_type": w.worker_type,
                "bootstrap_port": w.bootstrap_port,
                "labels": w.label_map,
            }

    def registration(self, url: str) -> WorkerRegistration:
        """The registration of the worker at ``url`` (as the plan labels it); KeyError when it has none."""
        for worker in self.workers:
            if worker.url == url:
                return worker
        raise KeyError(f"router of model {self.model!r} registers no worker at {url}")


@dataclass(frozen=True)
class LaunchSpecs:
    engine_kind: EngineKind
    engines: tuple[EngineProcessLaunch, ...]
    routers: tuple[RouterLaunch, ...]
    notes: tuple[str, ...] = ()

    def for_engine(self, engine_id: str) -> tuple[EngineProcessLaunch, ...]:
        return self._by_engine.get(engine_id, ())

    @functools.cached_property
    def _by_engine(self) -> dict[str, tuple[EngineProcessLaunch, ...]]:
        by_engine: dict[str, list[EngineProcessLaunch]] = {}
        for launch in self.engines:
            by_engine.setdefault(launch.engine_id, []).append(launch)
        return {engine_id: tuple(launches) for engine_id, launches in by_engine.items()}

    def router(self, model: str) -> RouterLaunch:
        for router in self.routers:
            if router.model == model:
                return router
        raise KeyError(model)


def check_deploy_settings(settings: SGLangDeployConf, fields: Collection[str] | None) -> list[Problem]:
    """Problems with ``sglang_deploy`` (server defaults, router settings, and every other setting:
    :func:`~miles_sglang_plugin.rendering.deploy_checks.deploy_setting_problems`); empty when fine."""
    out: list[Problem] = []
    for key in settings.server_defaults:
        norm = key.replace("-", "_")
        path = f"sglang_deploy.server_defaults.{key}"
        if norm in PLAN_OWNED_DEFAULTS:
            out.append(Problem(path, f"cannot be set deployment-wide: {PLAN_OWNED_DEFAULTS[norm]}"))
        elif fields is not None and norm not in fields:
            close = suggest(norm, fields)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            out.append(Problem(path, f"is not a ServerArgs field of the installed SGLang{hint}"))
    try:
        router = RouterSettings.from_mapping(asdict(settings.router))
    except (TypeError, ValueError) as exc:
        out.append(Problem("sglang_deploy.router", str(exc)))
    else:
        out += [Problem("sglang_deploy.router", msg) for msg in validate_router_settings(router)]
    return out + deploy_setting_problems(settings)


def _process_values(
    plan: DeploymentPlan,
    engine: EnginePlan,
    process: EngineProcessPlan,
    ports: PortAssignment,
    host: str,
    dist_host: str,
) -> dict[str, Any]:
    """The values of :data:`PER_PROCESS_FIELDS` of one engine process: its seed, addresses, ports and rank."""
    engine_id = engine.id
    own = ports.engines[(engine_id, process.node_rank)]
    first = own if process.node_rank == 0 else ports.engines[(engine_id, 0)]
    assert first.dist_init is not None, "node rank 0 of every engine gets a dist_init port (assign_ports)"
    return {
        "random_seed": plan.trainer.seed + process.rank,
        "host": host,
        "port": own.http,
        "nccl_port": own.nccl,
        "dist_init_addr": host_port(dist_host, first.dist_init),
        "nnodes": engine.nnodes,
        "node_rank": process.node_rank,
        "engine_info_bootstrap_port": first.engine_info_bootstrap,
        "disaggregation_bootstrap_port": first.disaggregation_bootstrap,
    }


def _placement_args(plan: DeploymentPlan, group: GroupPlan, own: Mapping[str, Any]) -> dict[str, Any]:
    """What the plan decides for every engine process: model, seed, addresses and ports, node rank, TP."""
    return {
        "model_path": group.overrides.get("model_path"),
        "trust_remote_code": True,
        "random_seed": own["random_seed"],
        "host": own["host"],
        "port": own["port"],
        "nccl_port": own["nccl_port"],
        "dist_init_addr": own["dist_init_addr"],
        "nnodes": own["nnodes"],
        "node_rank": own["node_rank"],
        "base_gpu_id": 0,
        "gpu_id_step": 1,
        "tp_size": group.tp_size,
        "enable_memory_saver": plan.trainer.offload_rollout,
        "skip_server_warmup": True,
        "enable_metrics": True,
        "enable_draft_weights_cpu_backup": True,
        "engine_info_bootstrap_port": own["engine_info_bootstrap_port"],
    }


def _disaggregation_args(worker_type: WorkerType, own: Mapping[str, Any]) -> dict[str, Any]:
    """Miles' PD flags: the mode, a prefill engine's bootstrap port and load balancing."""
    if worker_type is WorkerType.prefill:
        return {
            "disaggregation_mode": "prefill",
            "disaggregation_bootstrap_port": own["disaggregation_bootstrap_port"],
            "load_balance_method": "round_robin",
        }
    if worker_type is WorkerType.decode:
        return {"disaggregation_mode": "decode", "prefill_round_robin_balance": True}
    return {}


def _trainer_feature_args(trainer: TrainerInputs) -> dict[str, Any]:
    """Routing replay, indexer replay and fp16, as the trainer asks."""
    values: dict[str, Any] = {}
    if trainer.use_rollout_routing_replay:
        values["enable_return_routed_experts"] = True
    if trainer.use_rollout_indexer_replay:
        values["enable_return_indexer_topk"] = True
    if trainer.fp16:
        values["dtype"] = "float16"
    return values


def _engine_server_args(
    plan: DeploymentPlan,
    group: GroupPlan,
    own: Mapping[str, Any],
    settings: SGLangDeployConf,
    fields: Collection[str] | None,
    dropped: set[str],
    lora_paths: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The ServerArgs values of an engine process of ``group`` whose own values are ``own``: Miles' derived
    defaults (colocate) < server defaults < the plan's values < group overrides. Values the plan derives for
    fields the installed SGLang lacks are left out and added to ``dropped``. ``lora_paths``: the adapters to
    preload (None: ``settings.lora.paths``)."""
    derived = {
        **_placement_args(plan, group, own),
        **_disaggregation_args(group.worker_type, own),
        **_trainer_feature_args(plan.trainer),
        **lora_server_args(settings.lora, colocate=plan.trainer.colocate, paths=lora_paths),
    }
    if settings.api_key:
        derived["api_key"] = settings.api_key

    defaults = {k.replace("-", "_"): v for k, v in settings.server_defaults.items()}
    if group.worker_type is WorkerType.decode:
        defaults.pop("enable_hierarchical_cache", None)  # Miles never fills it for decode workers
    miles_defaults = thaw(plan.derived_server_defaults)
    values = {**miles_defaults, **defaults, **derived, **thaw(group.overrides)}
    if fields is not None:
        for key in [k for k in {**miles_defaults, **derived} if k not in fields and k not in group.overrides]:
            dropped.add(key)
            del values[key]
    return values


def standin_fault_env(settings: SGLangDeployConf, engine_id: str) -> dict[str, str]:
    """Fault-injection variables of the stand-in engine for ``engine_id`` (and its speed model)."""
    faults = settings.standin
    env: dict[str, str] = standin_speed_env(settings)
    if faults.start_delay_s:
        env["MSP_STANDIN_START_DELAY_S"] = str(faults.start_delay_s)
    if any(fnmatch.fnmatchcase(engine_id, pattern) for pattern in faults.fail_at_start):
        env["MSP_STANDIN_FAIL_AT_START"] = "1"
    if any(fnmatch.fnmatchcase(engine_id, pattern) for pattern in faults.never_healthy):
        env["MSP_STANDIN_NEVER_HEALTHY"] = "1"
    for pattern, seconds in faults.die_after_s.items():
        if fnmatch.fnmatchcase(engine_id, pattern):
            env["MSP_STANDIN_DIE_AFTER_S"] = str(seconds)
    if faults.control_latency_s:
        env["MSP_STANDIN_CONTROL_LATENCY_S"] = str(faults.control_latency_s)
    return env


def standin_speed_env(settings: SGLangDeployConf) -> dict[str, str]:
    """``MSP_STANDIN_SPEED`` (the speed model's parameters as JSON) when ``sglang_deploy.standin.speed`` is on."""
    speed = asdict(settings.standin.speed)
    if not speed.pop("enabled"):
        return {}
    return {"MSP_STANDIN_SPEED": json.dumps(speed, sort_keys=True)}


def _worker_registration(
    launch: EngineProcessLaunch, model: ModelPlan, group: GroupPlan
) -> WorkerRegistration:
    """How the engine of ``launch`` (its first process) registers with its model's router, labelled with
    what the plan decided for it (:func:`worker_labels`)."""
    labels = worker_labels(
        model=model.name,
        group=group.name,
        worker_type=launch.worker_type.value,
        engine_id=launch.engine_id,
        needs_offload=group.needs_offload,
        update_weights=model.update_weights,
    )
    return WorkerRegistration(
        url=launch.url,
        worker_type=launch.worker_type.value,
        bootstrap_port=launch.bootstrap_port if launch.worker_type is WorkerType.prefill else None,
        labels=tuple(labels.items()),
    )


#: The group label of a model's external engines (as the deployment names their group).
EXTERNAL_GROUP_LABEL = "external"


def _external_registration(model: ModelPlan, engine: ExternalEnginePlan) -> WorkerRegistration:
    """How an external engine registers: as given, labelled as the model's external group."""
    labels = worker_labels(
        model=model.name,
        group=EXTERNAL_GROUP_LABEL,
        worker_type=engine.worker_type.value,
        engine_id=engine.id,
        needs_offload=False,  # holds no GPU of the deployment
        update_weights=model.update_weights,
    )
    return WorkerRegistration(
        url=engine.url,
        worker_type=engine.worker_type.value,
        bootstrap_port=engine.bootstrap_port,
        labels=tuple(labels.items()),
    )


@dataclass
class _EngineRendering:
    """What every engine process of one rendering shares; collects the ServerArgs fields left out."""

    plan: DeploymentPlan
    settings: SGLangDeployConf
    ports: PortAssignment
    host_of_node: Callable[[int], str]
    server_arg_fields: Collection[str] | None
    kind: EngineKind
    prefix: tuple[str, ...]
    #: The launcher's values of Miles' engine variables (those its environment has): they win over Miles'
    #: defaults, as in Miles.
    launcher_env: Mapping[str, str] = field(default_factory=dict)
    #: The adapters the engines preload (None: ``settings.lora.paths``, as given).
    lora_paths: Mapping[str, str] | None = None
    dropped: set[str] = field(default_factory=set)
    #: ``cpu_sglang``: the fields left out because a CPU cannot run them -> why.
    cpu_dropped: dict[str, str] = field(default_factory=dict)
    #: Groups (``model/group``) whose engines load dummy weights, so preload no adapter (Miles' rule).
    dummy_lora: list[str] = field(default_factory=list)

    def model_engines(self, model: ModelPlan) -> tuple[list[EngineProcessLaunch], list[WorkerRegistration]]:
        """Every engine process of ``model``, and the workers its router registers (one per engine)."""
        launches: list[EngineProcessLaunch] = []
        workers: list[WorkerRegistration] = []
        hosts: dict[int, str] = {}  # each node's address, asked once

        def host_of(node: int) -> str:
            host = hosts.get(node)
            if host is None:
                host = hosts[node] = self.host_of_node(node)
            return host

        for group in model.groups:
            template: ProcessTemplate | None = None
            for engine in group.engines:
                dist_host = host_of(engine.processes[0].node)
                for process in engine.processes:
                    own = _process_values(
                        self.plan, engine, process, self.ports, host_of(process.node), dist_host
                    )
                    template = template or self.template(model, group, own)
                    launch = self.process_launch(model, group, engine, process, own, template)
                    launches.append(launch)
                    if process.node_rank == 0:
                        workers.append(_worker_registration(launch, model, group))
        return launches, workers

    def template(self, model: ModelPlan, group: GroupPlan, own: Mapping[str, Any]) -> ProcessTemplate:
        """What the processes of ``group`` share, from the values of one of them (``own``)."""
        values = _engine_server_args(
            self.plan, group, own, self.settings, self.server_arg_fields, self.dropped, self.lora_paths
        )
        if (
            values.get("load_format") == "dummy"
            and values.get("lora_paths")
            and "lora_paths" not in group.overrides
        ):
            # Miles preloads no adapter into dummy weights (sglang_engine.py): the weight sync brings both.
            del values["lora_paths"]
            self.dummy_lora.append(f"{model.name}/{group.name}")
        cpu = self.kind is EngineKind.cpu_sglang
        if cpu:
            values = cpu_server_args(values, self.cpu_dropped)
        own_keys = tuple(k for k in values if k in own and k not in group.overrides)
        # Miles' rule by this group's own engine width (Miles: by rollout_num_gpus_per_engine, one width for
        # every group); the launcher's value, where it has one, wins as for Miles' other defaults.
        custom_all_reduce = "0" if self.plan.trainer.colocate and group.num_gpus_per_engine > 1 else "1"
        # Miles' engine defaults (the launcher's values where it has them) < the stand-in's faults <
        # sglang_deploy.env < the CPU kind's variables (its shim before the user's PYTHONPATH) <
        # CUDA_VISIBLE_DEVICES
        env_tail = {
            CUSTOM_ALL_REDUCE_ENV: self.launcher_env.get(CUSTOM_ALL_REDUCE_ENV, custom_all_reduce),
            **self.settings.env,
            **(cpu_engine_env(self.settings.env.get("PYTHONPATH")) if cpu else {}),
        }
        simulated = self.kind is EngineKind.simulated
        env_head = engine_env_defaults(MILES_ENGINE_ENV, self.launcher_env)
        return ProcessTemplate.of(
            self.prefix, values, own_keys, env_head, env_tail, self.settings if simulated else None
        )

    def process_launch(
        self,
        model: ModelPlan,
        group: GroupPlan,
        engine: EnginePlan,
        process: EngineProcessPlan,
        own: Mapping[str, Any],
        template: ProcessTemplate,
    ) -> EngineProcessLaunch:
        given = template.own_of(own)
        bootstrap_port = template.value("disaggregation_bootstrap_port", own)
        ids = process.local_gpu_ids
        return EngineProcessLaunch(
            engine_id=engine.id,
            model=model.name,
            group=group.name,
            worker_type=group.worker_type,
            node=process.node,
            node_rank=process.node_rank,
            nnodes=engine.nnodes,
            host=own["host"],
            port=int(template.value("port", own)),
            template=template,
            own=given,
            visible_devices=str(ids[0]) if len(ids) == 1 else ",".join(map(str, ids)),
            bootstrap_port=int(bootstrap_port) if bootstrap_port is not None else None,
        )


def router_settings(model: ModelPlan, settings: SGLangDeployConf) -> RouterSettings:
    """The settings of ``model``'s router: ``sglang_deploy.router`` with the gateway decided, dp-aware
    routing when its engines run DP attention (Miles: ``--sglang-enable-dp-attention`` sets
    ``router_dp_aware``), unless ``router.extra.dp_aware`` says otherwise, and the circuit breaker, when not
    set, off for a PD router and on for a regular one."""
    router = RouterSettings.from_mapping(asdict(settings.router)).resolved()
    if model.dp_attention and "dp_aware" not in router.extra:
        router = replace(router, extra={**router.extra, "dp_aware": True})
    if router.disable_circuit_breaker is None:  # off for PD: a pair's failure opens both workers' circuits
        router = replace(router, disable_circuit_breaker=model.is_pd)
    return router


def _router_launch(
    model: ModelPlan,
    settings: SGLangDeployConf,
    ports: PortAssignment,
    router_host: str,
    workers: list[WorkerRegistration],
) -> RouterLaunch:
    router_ports = ports.routers[model.name]
    spec = RouterLaunchSpec(
        model=model.name,
        host=router_host,
        port=router_ports.http,
        prometheus_port=router_ports.prometheus,
        pd_disaggregation=model.is_pd,
        settings=router_settings(model, settings),
        api_key=settings.api_key,
    )
    return RouterLaunch(model=model.name, spec=spec, workers=tuple(workers))


def _dp_aware_note(model: ModelPlan, router: RouterLaunch) -> str | None:
    """A dp-aware router's note: why it is dp-aware, and what sglang-router 0.3.2 cannot do then."""
    settings = router.spec.settings
    if router.model != model.name or not settings.extra.get("dp_aware"):
        return None
    why = "its engines run DP attention, as Miles sets it" if model.dp_attention else "router.extra.dp_aware"
    note = f"router of model {router.model!r} is dp-aware ({why})"
    if settings.gateway == "sglang_router":
        note += (
            "; sglang-router 0.3.2 cannot take a dp-aware worker out (its removal job fails), so a lost engine "
            "stays listed: gateway=smg can"
        )
    return note


def _launcher_env_notes(launcher_values: Mapping[str, str], user_env: Mapping[str, str]) -> tuple[str, ...]:
    """A note naming Miles' engine variables whose value comes from the launcher's environment (those that
    ``sglang_deploy.env`` does not set, which wins over both)."""
    taken = [
        f"{name}={shell_quote(value)}"
        + (f" (Miles: {MILES_ENGINE_ENV[name]})" if name in MILES_ENGINE_ENV else "")
        for name, value in launcher_values.items()
        if name not in user_env
    ]
    if not taken:
        return ()
    return (
        "engine environment from the launcher's, over Miles' defaults (as Miles does): " + ", ".join(taken),
    )


def render_launch(
    plan: DeploymentPlan,
    settings: SGLangDeployConf,
    ports: PortAssignment,
    *,
    host_of_node: Callable[[int], str],
    router_host: str,
    server_arg_fields: Collection[str] | None = None,
    python: str = sys.executable,
    launcher_env: Mapping[str, str] | None = None,
    lora_paths: Mapping[str, str] | None = None,
) -> LaunchSpecs:
    """Every engine process's argv and environment, and every router's launch spec (no I/O).

    ``launcher_env``: the launcher's environment (None: this process's), read once here for Miles' engine
    variables: where it has one of them, its value wins over Miles' default, as in Miles
    (``server_group.py``: ``os.environ.get(key, default)``), and the rendered environment records it.
    ``lora_paths``: the adapters the engines preload (None: ``settings.lora.paths``, as given; see
    :func:`~miles_sglang_plugin.rendering.lora.lora_preload`)."""
    kind = EngineKind(settings.launch.engine)
    environ = os.environ if launcher_env is None else launcher_env
    miles_names = (*MILES_ENGINE_ENV, CUSTOM_ALL_REDUCE_ENV)
    launcher_values = {name: environ[name] for name in miles_names if name in environ}
    prefix = STANDIN_COMMAND if kind is EngineKind.simulated else tuple(settings.launch.command)
    rendering = _EngineRendering(
        plan=plan,
        settings=settings,
        ports=ports,
        host_of_node=host_of_node,
        server_arg_fields=server_arg_fields,
        kind=kind,
        prefix=tuple(python if part == "{python}" else part for part in prefix),
        launcher_env=launcher_values,
        lora_paths=lora_paths,
    )
    engines: list[EngineProcessLaunch] = []
    routers: list[RouterLaunch] = []
    for model in plan.models:
        launches, workers = rendering.model_engines(model)
        engines += launches
        workers += [_external_registration(model, engine) for engine in model.external]
        if model.has_router:
            routers.append(_router_launch(model, settings, ports, router_host, workers))
    notes = tuple(
        f"left out {key}: Miles sets it, but the installed SGLang has no such ServerArgs field"
        for key in sorted(rendering.dropped)
    ) + tuple(note for model in plan.models for router in routers if (note := _dp_aware_note(model, router)))
    if kind is EngineKind.cpu_sglang:
        notes += cpu_notes(rendering.cpu_dropped)
    notes += _launcher_env_notes(launcher_values, settings.env)
    if rendering.dummy_lora:
        notes += (
            f"LoRA adapters not preloaded by {', '.join(rendering.dummy_lora)}: their engines load dummy weights "
            "(load_format=dummy), and the first weight sync brings the adapter with the weights, as in Miles",
        )
    return LaunchSpecs(engine_kind=kind, engines=tuple(engines), routers=tuple(routers), notes=notes)
