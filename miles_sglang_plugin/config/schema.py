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

Every field carries a docstring (the string under it: what it is and its unit; the default is the field's own),
printed by ``miles-sglang fields [PATH]`` (:mod:`miles_sglang_plugin.config.field_docs`); a test checks that no
field lacks one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from omegaconf import II

from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.config.locating import register_resolvers
from miles_sglang_plugin.config.shared_fields import RouterFields, TrainerFields
from miles_sglang_plugin.config.trainer_mappings import TrainerKind

# The defaults below interpolate ``msp.trainer`` / ``msp.rollout_num_gpus``: registered wherever these classes
# are, so that a process that only unpickles a composed config (a Ray task of the trainer: its typed nodes
# import this module) resolves it as the driver does.
register_resolvers()

#: Group slots of a model, in their default deployment order.
GROUP_SLOTS: tuple[str, ...] = ("prefill", "decode", "regular", "placeholder")

#: Default interpolations; an untouched default means "inherit" (the resolver applies Miles' fallback chain).
#: ``msp.trainer`` finds the trainer's input next to the group's node, then outwards up to the root
#: (:mod:`miles_sglang_plugin.config.locating`).
GROUP_GPUS_PER_ENGINE_DEFAULT = "${..num_gpus_per_engine}"
EXTRA_GROUP_GPUS_PER_ENGINE_DEFAULT = "${...num_gpus_per_engine}"
MODEL_GPUS_PER_ENGINE_DEFAULT = "${msp.trainer:rollout_num_gpus_per_engine,1}"
MODEL_PATH_DEFAULT = "${msp.trainer:hf_checkpoint,null}"


@dataclass
class ServerGroupConf:
    """A server group in one of a model's fixed slots; its worker type is the slot's name."""

    num_gpus: int = 0
    """GPUs of the group, in GPUs; 0 turns the group off."""
    num_gpus_per_engine: int = II("..num_gpus_per_engine")
    """GPUs per engine (TP x PP) of this group, in GPUs; default: the model's."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """SGLang ServerArgs values for this group's engines (field -> value), applied last; add keys with ``+``."""


@dataclass
class ExtraServerGroupConf:
    """A further group of a model (``sglang.<model>.extra_groups.<name>``), e.g. a second decode group."""

    worker_type: WorkerType = WorkerType.regular
    """What the group runs: regular, prefill, decode or placeholder (GPUs reserved, no engines)."""
    num_gpus: int = 0
    """GPUs of the group, in GPUs; 0 turns the group off."""
    num_gpus_per_engine: int = II("...num_gpus_per_engine")
    """GPUs per engine (TP x PP) of this group, in GPUs; default: the model's."""
    overrides: dict[str, Any] = field(default_factory=dict)
    """SGLang ServerArgs values for this group's engines (field -> value), applied last; add keys with ``+``."""


@dataclass
class ModelConf:
    """One model behind one router."""

    model_path: str | None = II("msp.trainer:hf_checkpoint,null")
    """Checkpoint the model's engines serve (a path or hub name); default: the trainer's hf_checkpoint."""
    update_weights: bool | None = None
    """Whether training pushes weights to this model; null: true iff its path is the trainer's hf_checkpoint."""
    num_gpus_per_engine: int = II("msp.trainer:rollout_num_gpus_per_engine,1")
    """GPUs per engine (TP x PP) of the model's groups, in GPUs; default: the trainer's rollout_num_gpus_per_engine."""
    prefill: ServerGroupConf = field(default_factory=ServerGroupConf)
    """The prefill group of a PD-disaggregated model (needs a decode group)."""
    decode: ServerGroupConf = field(default_factory=ServerGroupConf)
    """The decode group of a PD-disaggregated model (needs a prefill group)."""
    regular: ServerGroupConf = field(default_factory=ServerGroupConf)
    """The group of regular (not disaggregated) engines."""
    placeholder: ServerGroupConf = field(default_factory=ServerGroupConf)
    """GPUs reserved in the layout without engines (e.g. kept for training)."""
    extra_groups: dict[str, Any] = field(default_factory=dict)
    """Further groups by name (each an ExtraServerGroupConf: ``+sglang_group@...=decode`` or a plain mapping)."""
    group_order: list[str] = field(default_factory=list)
    """Order of the groups on the GPUs (names); empty: prefill, decode, regular, placeholder, then extra groups."""
    external: list[Any] = field(default_factory=list)
    """Engines already running elsewhere, served by this model's router: a URL or ``{url, worker_type, bootstrap_port}``."""
    # Miles' ``rollout_external`` / slime's external engines: health, routing and control reach them; teardown
    # leaves them running.


class EngineKind(StrEnum):
    """What runs as an engine: real SGLang, the HTTP stand-in for machines without GPUs, or real SGLang on a
    CPU (``cpu_sglang``: the CPU flags and shim of :mod:`miles_sglang_plugin.rendering.cpu_engine`)."""

    sglang = "sglang"
    simulated = "simulated"
    cpu_sglang = "cpu_sglang"


class BackendKind(StrEnum):
    """Where engines run: subprocesses of this machine (``local``), or Ray actors on a cluster's nodes (``ray``)."""

    local = "local"
    ray = "ray"


class EngineActors(StrEnum):
    """How many Ray actors start and watch the engine processes: one per node (``per_node``), or one per
    engine process (``per_process``)."""

    per_node = "per_node"
    per_process = "per_process"


@dataclass
class RouterConf(RouterFields):
    """The router of each model (sglang-router or SMG, the same settings for both), one router per model.

    Its fields are declared once, in :class:`~miles_sglang_plugin.config.shared_fields.RouterFields`, which the
    frozen :class:`~miles_sglang_plugin.rendering.router_specs.RouterSettings` derives from as well."""

    # Narrowed to ``dict``, the mapping type OmegaConf accepts (the declaration, docstring included, is the base's).
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class RayConf:
    """The ``ray`` backend: engines under Ray actors on the nodes of a running Ray cluster."""

    address: str | None = None
    """Cluster to connect to when not connected yet; null: ``$RAY_ADDRESS``, else this machine's (``ray start --head``)."""
    start_local_cluster: bool = False
    """Start a one-machine Ray cluster when none is found (off: a missing cluster is an error, never started silently)."""
    placement_timeout_s: float = 120.0
    """Deadline for the placement group to be placed and the engine actors to start, in seconds."""
    engine_actors: EngineActors = EngineActors.per_node
    """per_node: one Ray actor per node starts and watches all engine processes of that node (Ray starts one worker process per actor, ~0.5 s of CPU each); per_process: one actor per engine process (an actor's death takes only its own process)."""
    engine_num_cpus: float = 0.0
    """CPUs reserved per engine process, by the actor that starts it (its engine process uses the node's CPUs either way)."""
    bundle_gpu_share: float = 0.2
    """Share of its first bundle's GPU each engine actor reserves in the trainer's placement group (Miles: 0.2)."""


@dataclass
class LaunchConf:
    """How engines are started and stopped."""

    engine: EngineKind = EngineKind.sglang
    """What runs as an engine: sglang (real SGLang), simulated (the HTTP stand-in, for machines without GPUs) or cpu_sglang (real SGLang on a CPU, tiny models only)."""
    backend: BackendKind = BackendKind.local
    """Where engines run: local (subprocesses of this machine) or ray (Ray actors on a cluster's nodes; see the docs' Backends page)."""
    command: list[str] = field(default_factory=lambda: ["{python}", "-m", "sglang.launch_server"], repr=False)
    """Command prefix of an engine (``{python}``: this interpreter; ``[sglang, serve]`` works too)."""
    # Not in repr: it may hold a secret flag (--admin-api-key), masked wherever a command is shown.
    host: str = "127.0.0.1"
    """Address engines and routers bind to on a single machine."""
    startup_timeout_s: float = 600.0
    """Longest the whole deployment may take to become ready, in seconds."""
    poll_interval_s: float = 0.25
    """Time between health polls during start-up, in seconds."""
    shutdown_grace_s: float = 10.0
    """Time between SIGTERM and SIGKILL when stopping, in seconds."""
    drain_timeout_s: float = 60.0
    """Longest an engine removed by a change of the running deployment (``apply``) may take, out of its router, to finish its requests before it is stopped, in seconds."""
    port_base: int = 15000
    """First port tried for engines and routers (searched upward, below the ephemeral range; Miles: 15000)."""
    port_max: int = 32767
    """Last port that may be used."""
    log_dir: str | None = None
    """Directory of the engine and router logs; null: ``sglang_logs`` in the Hydra run directory."""
    live: str = "auto"
    """Start-up display: auto (a live table on a terminal, plain lines otherwise), always, never (no progress lines)."""
    ray: RayConf = field(default_factory=RayConf)
    """Settings of the ``ray`` backend."""


@dataclass
class LoraConf:
    """LoRA serving on every engine, with the server arguments Miles derives from its ``--lora-*`` and
    ``--multi-lora-*`` arguments (see :mod:`miles_sglang_plugin.rendering.lora`)."""

    enabled: bool = False
    """Single LoRA on every engine (Miles: ``--lora-rank`` > 0 or ``--lora-adapter-path``, not ``--lora-train-only``)."""
    paths: dict[str, str] = field(default_factory=dict)
    """Adapters (name -> path) loaded at start as ``--lora-paths name=path`` (a directory must hold ``adapter_config.json``); Miles' ``miles_lora`` only under debug_rollout_only (else its weight sync brings it)."""
    max_loras_per_batch: int | None = None
    """Most adapters in one batch; null: Miles' value (1; multi-LoRA: ``multi_lora_n_adapters``)."""
    max_lora_rank: int = 8
    """Largest adapter rank served (Miles: ``max(--lora-rank, 1)``)."""
    target_modules: list[str] = field(default_factory=list)
    """HF or Megatron module names the adapters apply to (Megatron names mapped as Miles does); empty: SGLang's default."""
    multi_lora_n_adapters: int = 0
    """Multi-LoRA (Miles' ``--multi-lora-n-adapters``): adapter slots per batch; > 0 also turns LoRA on."""
    base_cpu_backup: bool = False
    """Colocated single-LoRA engines keep a CPU copy of the base weights (Miles' ``--lora-base-cpu-backup``)."""


@dataclass
class StandInSpeedConf:
    """How fast the stand-in engines generate (``launch.engine=simulated`` only): a continuous-batching model
    whose decode step gets faster with the engine's TP, so that sweeps with stand-ins measure something. Off
    by default (requests answer at once). Formulas: ``miles_sglang_plugin/standin/speed.py`` and the docs' Sweeps page."""

    enabled: bool = False
    """Pace the stand-ins' generation by this model (off: requests answer at once)."""
    latency_s: float = 0.002
    """Wait before the first token of each request, on top of the prefill, in seconds."""
    prefill_tokens_per_s: float = 20000.0
    """Prefill rate per GPU of the engine (``--tp-size`` GPUs), in tokens/s."""
    decode_step_s: float = 0.020
    """Part of one decode step at TP 1 that every step pays (the weights read), in seconds."""
    decode_token_s: float = 0.0005
    """Part of one decode step at TP 1 per sequence in the batch, in seconds."""
    tp_comm_s: float = 0.001
    """Added to each decode step per further TP rank (the all-reduce), in seconds."""


@dataclass
class StandInFaultsConf:
    """Fault injection for the engine stand-in (``launch.engine=simulated`` only). Engine patterns match engine
    ids such as ``actor.decode.1`` (shell-style wildcards: ``actor.*``)."""

    speed: StandInSpeedConf = field(default_factory=StandInSpeedConf)
    """The stand-in's speed model (not a fault: how long its requests take)."""
    start_delay_s: float = 0.0
    """Delay before each stand-in engine starts answering, in seconds."""
    fail_at_start: list[str] = field(default_factory=list)
    """Engine patterns whose stand-in exits at start."""
    never_healthy: list[str] = field(default_factory=list)
    """Engine patterns whose stand-in never reports healthy."""
    die_after_s: dict[str, float] = field(default_factory=dict)
    """Engine pattern -> time after which that stand-in exits, in seconds."""
    control_latency_s: float = 0.0
    """Time each control call (memory release/resume, weight updates, pause, ...) takes on a stand-in, in seconds."""


@dataclass
class SupervisionConf:
    """Watching the engines and routers of a running deployment, and healing it (see the docs' Serve page)."""

    enabled: bool = True
    """Watch and heal after start-up; off: nothing is watched (``deployment.exited()`` still tells)."""
    health_endpoint: str = "/health"
    """What is polled: /health (answers while offloaded) or /health_generate (a generation, as Miles' monitor)."""
    # /health_generate also notices a wedged scheduler; engines that are offloaded or paused, which cannot
    # generate, are then polled on /health meanwhile.
    health_interval_s: float = 1.0
    """Time between two polls of an engine, in seconds."""
    health_timeout_s: float = 2.0
    """Time a poll may take, in seconds."""
    failure_threshold: int = 2
    """Failed polls in a row after which an engine is lost (a hang); a process that exits is lost at once."""
    max_restarts: int = 3
    """Restarts of one engine (same argv, environment, GPUs) before the deployment fails whole; 0: fail fast."""
    restart_backoff_s: float = 1.0
    """Wait before the second restart of an engine, in seconds (the first is at once); restart n >= 2 waits
    ``restart_backoff_s * 2**(n-2)``, at most ``restart_backoff_max_s``."""
    restart_backoff_max_s: float = 30.0
    """Longest wait before a restart, in seconds."""
    restart_budget_reset_s: float = 600.0
    """Time a restarted engine must serve to get its restart budget back, in seconds."""
    kill_grace_s: float = 1.0
    """Time between SIGTERM and SIGKILL of a lost engine's processes, in seconds (a hung engine ignores SIGTERM)."""
    router_max_restarts: int = 3
    """Restarts of each router that exits (each re-populated with the serving engines), counted per router."""


@dataclass
class ControlConf:
    """The control handle's calls to the engines (``deployment.control``)."""

    timeout_s: float = 600.0
    """Deadline of one operation over all its engines, in seconds (a weight update from disk can take minutes)."""
    max_concurrency: int = 128
    """Most requests in flight at once per operation."""


@dataclass
class SGLangDeployConf:
    """Deployment-wide settings (not per model)."""

    launch: LaunchConf = field(default_factory=LaunchConf)
    """How engines are started and stopped."""
    router: RouterConf = field(default_factory=RouterConf)
    """Settings of every model's router."""
    server_defaults: dict[str, Any] = field(default_factory=dict)
    """Deployment-wide ServerArgs values (Miles' ``--sglang-*``; field -> value): the lowest precedence."""
    env: dict[str, str] = field(default_factory=dict, repr=False)  # may hold tokens: kept out of repr
    """Extra environment variables of every engine (above Miles' defaults, below CUDA_VISIBLE_DEVICES)."""
    lora: LoraConf = field(default_factory=LoraConf)
    """LoRA serving on every engine."""
    standin: StandInFaultsConf = field(default_factory=StandInFaultsConf)
    """Fault injection for the stand-in engines (``launch.engine=simulated`` only)."""
    supervision: SupervisionConf = field(default_factory=SupervisionConf)
    """Watching and healing the running deployment."""
    control: ControlConf = field(default_factory=ControlConf)
    """The control handle's calls to the engines."""
    api_key: str | None = field(default=None, repr=False)
    """API key of engines and routers (a secret: never printed or logged); null: env SGLANG_API_KEY (preferred)."""
    # A value given here is part of the config that Hydra saves in the run directory; the environment is not.


@dataclass
class MilesTrainerArgs(TrainerFields):
    """Trainer inputs under Miles' argument names, as a typed root schema a Hydra trainer can extend.

    Its first fields are those of :class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`, declared
    once in :class:`~miles_sglang_plugin.config.shared_fields.TrainerFields`, which both derive from. The
    group's own nodes follow."""

    # Narrowed to ``dict``, the mapping type OmegaConf accepts (the declaration, docstring included, is the base's).
    eval_sglang_overrides: dict[str, Any] = field(default_factory=dict)

    sglang: dict[str, ModelConf] = field(default_factory=dict)
    """The deployment's models by name, in GPU order (one router each); filled by the ``sglang`` group."""
    sglang_deploy: SGLangDeployConf = field(default_factory=SGLangDeployConf)
    """Deployment-wide settings: launcher, router, SGLang defaults, LoRA, API key, stand-in faults."""
    sglang_bench: Any = None
    """The rollout benchmark's settings (the ``sglang_bench`` group: ``+sglang_bench=default``); null: none."""


@dataclass
class SGLangTrainerConf:
    """A trainer whose own keys the plugin reads as its trainer inputs (``+sglang_trainer=verl``, ``skyrl``)."""

    trainer: TrainerKind = TrainerKind.verl
    """The trainer: verl (0.9.1's ppo_trainer keys) or skyrl (skyrl-train 0.3.1's ppo_base_config keys)."""
