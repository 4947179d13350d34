"""Structured configs (typed dataclasses) of the ``sglang`` Hydra config group.

Layout of a composed app config::

    sglang:                      # one entry per model (one router each), in deployment order
      actor:                     # ModelConf
        model_path: ...          # default: the trainer's hf_checkpoint
        update_weights: null     # null: inferred (effective model path == hf_checkpoint)
        num_gpus_per_engine: ... # default: the trainer's rollout_num_gpus_per_engine
        prefill: {num_gpus: 4, num_gpus_per_engine: 2, overrides: {}}   # ServerGroupConf slots,
        decode: {num_gpus: 8}                                            # num_gpus: 0 = group off
        regular: {num_gpus: 0}
        placeholder: {num_gpus: 0}
        extra_groups: {}         # more groups, e.g. a second decode group with another TP
        group_order: []          # optional explicit order of the groups (default: the order above)
    sglang_deploy: ...           # SGLangDeployConf: launcher, router and deployment-wide SGLang defaults

Groups are always present (``num_gpus: 0`` means off) so that ``sglang.actor.decode.num_gpus=12`` works for
every model without ``+``; None- or MISSING-valued group nodes break dotted overrides in OmegaConf 2.3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import II

from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.config.shared_fields import fields_of, mapping_as_dict
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs

#: Group slots of a model, in their default deployment order.
GROUP_SLOTS: tuple[str, ...] = ("prefill", "decode", "regular", "placeholder")

#: Default interpolations; an untouched default means "inherit" (the resolver applies Miles' fallback chain).
GROUP_GPUS_PER_ENGINE_DEFAULT = "${..num_gpus_per_engine}"
EXTRA_GROUP_GPUS_PER_ENGINE_DEFAULT = "${...num_gpus_per_engine}"
MODEL_GPUS_PER_ENGINE_DEFAULT = "${oc.select:rollout_num_gpus_per_engine,1}"
MODEL_PATH_DEFAULT = "${oc.select:hf_checkpoint,null}"


@dataclass
class ServerGroupConf:
    """A server group in one of a model's fixed slots; its worker type is the slot's name."""

    num_gpus: int = 0
    num_gpus_per_engine: int = II("..num_gpus_per_engine")
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class ExtraServerGroupConf:
    """A further group of a model (``sglang.<model>.extra_groups.<name>``), e.g. a second decode group."""

    worker_type: WorkerType = WorkerType.regular
    num_gpus: int = 0
    num_gpus_per_engine: int = II("...num_gpus_per_engine")
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConf:
    """One model behind one router."""

    model_path: str | None = II("oc.select:hf_checkpoint,null")
    update_weights: bool | None = None
    num_gpus_per_engine: int = II("oc.select:rollout_num_gpus_per_engine,1")
    prefill: ServerGroupConf = field(default_factory=ServerGroupConf)
    decode: ServerGroupConf = field(default_factory=ServerGroupConf)
    regular: ServerGroupConf = field(default_factory=ServerGroupConf)
    placeholder: ServerGroupConf = field(default_factory=ServerGroupConf)
    extra_groups: dict[str, ExtraServerGroupConf] = field(default_factory=dict)
    group_order: list[str] = field(default_factory=list)


class EngineKind(StrEnum):
    """What runs as an engine: real SGLang, or the HTTP stand-in for machines without GPUs."""

    sglang = "sglang"
    simulated = "simulated"


class BackendKind(StrEnum):
    """Where engines run: subprocesses of this machine (``local``), or Ray actors on a cluster's nodes (``ray``)."""

    local = "local"
    ray = "ray"


@dataclass
class RouterConf:
    """sglang-router (SGLang Model Gateway) settings, one router per model."""

    policy: str = "cache_aware"
    prefill_policy: str | None = None
    decode_policy: str | None = None
    request_timeout_secs: int = 14400
    health_check_interval_secs: int = 60
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: int = 5
    disable_health_check: bool = False
    retry_max_retries: int = 5
    disable_retries: bool = False
    cb_failure_threshold: int = 10
    cb_timeout_duration_secs: int = 60
    disable_circuit_breaker: bool = False
    log_level: str = "warn"
    #: Any other ``RouterArgs`` field, by name.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayConf:
    """The ``ray`` backend: engines under Ray actors on the nodes of a running Ray cluster."""

    #: The cluster to connect to when this process is not connected to one yet: null = ``$RAY_ADDRESS``, else
    #: the cluster started on this machine (``ray start --head``; Ray's ``address="auto"``).
    address: str | None = None
    #: Start a one-machine Ray cluster when none is found (off: a missing cluster is an error, never started
    #: silently).
    start_local_cluster: bool = False
    #: Deadline for the placement group to be placed and the engine actors to start on their nodes.
    placement_timeout_s: float = 120.0
    #: CPUs each engine actor reserves (its engine process uses the node's CPUs either way).
    engine_num_cpus: float = 0.0
    #: In a placement group handed over by the trainer (one GPU per bundle, Miles' layout), the share of its
    #: first bundle's GPU each engine actor reserves (Miles: 0.2, so that colocated training actors fit).
    bundle_gpu_share: float = 0.2


@dataclass
class LaunchConf:
    """How engines are started and stopped."""

    engine: EngineKind = EngineKind.sglang
    #: Which backend places and runs the engines (see the README's backends section).
    backend: BackendKind = BackendKind.local
    #: Command prefix of an engine; ``{python}`` is this interpreter. ``[sglang, serve]`` also works. Not in
    #: repr: it may hold a secret flag (``--admin-api-key``), which is masked wherever a command is shown.
    command: list[str] = field(default_factory=lambda: ["{python}", "-m", "sglang.launch_server"], repr=False)
    #: Address engines and routers bind to on a single machine.
    host: str = "127.0.0.1"
    startup_timeout_s: float = 600.0
    poll_interval_s: float = 0.25
    shutdown_grace_s: float = 10.0
    #: Ports are searched upward from here, below the ephemeral range (Miles starts at 15000).
    port_base: int = 15000
    port_max: int = 32767
    #: Log directory (default: ``sglang_logs`` under the Hydra run directory).
    log_dir: str | None = None
    #: Live status display: auto (a terminal), always, never.
    live: str = "auto"
    #: Settings of the ``ray`` backend.
    ray: RayConf = field(default_factory=RayConf)


@dataclass
class LoraConf:
    """LoRA serving on every engine, with the server arguments Miles derives from its ``--lora-*`` and
    ``--multi-lora-*`` arguments (see :mod:`miles_sglang_plugin.rendering.lora`)."""

    #: Single LoRA (Miles: ``--lora-rank`` > 0 or ``--lora-adapter-path``, without ``--lora-train-only``).
    enabled: bool = False
    #: adapter name -> path, rendered as ``--lora-paths name=path`` (Miles: ``miles_lora=<--lora-adapter-path>``).
    paths: dict[str, str] = field(default_factory=dict)
    #: null: Miles' value, 1 (multi-LoRA: ``multi_lora_n_adapters``).
    max_loras_per_batch: int | None = None
    #: Miles: ``max(--lora-rank, 1)``.
    max_lora_rank: int = 8
    #: HF or Megatron module names (Miles' ``--target-modules``; Megatron names are mapped to HF ones as Miles
    #: does); empty: SGLang's default (single LoRA only).
    target_modules: list[str] = field(default_factory=list)
    #: Multi-LoRA (Miles' ``--multi-lora-n-adapters``): > 0 adapter slots per batch, which also turns LoRA on.
    multi_lora_n_adapters: int = 0
    #: Miles' ``--lora-base-cpu-backup``: colocated single-LoRA engines keep a CPU copy of the base weights.
    base_cpu_backup: bool = False


@dataclass
class StandInSpeedConf:
    """How fast the stand-in engines generate (``launch.engine=simulated`` only): a continuous-batching model
    whose decode step gets faster with the engine's TP, so that sweeps with stand-ins measure something. Off
    by default (requests answer at once). Formulas: ``miles_sglang_plugin/standin/speed.py`` and the README."""

    enabled: bool = False
    #: Before the first token of each request, on top of the prefill (seconds).
    latency_s: float = 0.002
    #: Prefill rate per GPU of the engine (``--tp-size`` GPUs), tokens/s.
    prefill_tokens_per_s: float = 20000.0
    #: One decode step at TP 1: the part every step pays (weights read), and the part per sequence in the batch.
    decode_step_s: float = 0.020
    decode_token_s: float = 0.0005
    #: Added to each step per further TP rank (the all-reduce).
    tp_comm_s: float = 0.001


@dataclass
class StandInFaultsConf:
    """Fault injection for the engine stand-in (``launch.engine=simulated`` only). Engine patterns match engine
    ids such as ``actor.decode.1`` (shell-style wildcards: ``actor.*``)."""

    #: The stand-in's speed model (not a fault: how long its requests take).
    speed: StandInSpeedConf = field(default_factory=StandInSpeedConf)

    start_delay_s: float = 0.0
    fail_at_start: list[str] = field(default_factory=list)
    never_healthy: list[str] = field(default_factory=list)
    #: pattern -> seconds after which the engine exits
    die_after_s: dict[str, float] = field(default_factory=dict)


@dataclass
class SGLangDeployConf:
    """Deployment-wide settings (not per model)."""

    launch: LaunchConf = field(default_factory=LaunchConf)
    router: RouterConf = field(default_factory=RouterConf)
    #: Deployment-wide ServerArgs values (Miles' ``--sglang-*`` flags): lowest precedence.
    server_defaults: dict[str, Any] = field(default_factory=dict)
    #: Extra environment variables for every engine (above Miles' defaults, below CUDA_VISIBLE_DEVICES).
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold tokens: kept out of repr
    lora: LoraConf = field(default_factory=LoraConf)
    standin: StandInFaultsConf = field(default_factory=StandInFaultsConf)
    #: API key of engines and routers. A secret: never printed, logged or written to a plan. Prefer the
    #: environment variable SGLANG_API_KEY (read when this is null): a value given here is part of the
    #: config that Hydra saves in the run directory.
    api_key: str | None = field(default=None, repr=False)


@dataclass
@fields_of(TrainerInputs, retype=mapping_as_dict)
class MilesTrainerArgs:
    """Trainer inputs under Miles' argument names, as a typed root schema a Hydra trainer can extend.

    Its first fields are those of :class:`TrainerInputs` (names, types, defaults; each one's meaning is
    documented there), copied from it, followed by the group's own nodes."""

    #: Filled by the ``sglang`` group (models by name) and its presets (deployment settings).
    sglang: dict[str, ModelConf] = field(default_factory=dict)
    sglang_deploy: SGLangDeployConf = field(default_factory=SGLangDeployConf)
    #: The rollout benchmark's settings (the ``sglang_bench`` group: ``+sglang_bench=default``); null: none.
    sglang_bench: Any = None
