"""Fields declared once for two dataclasses each: the Hydra schema a config is composed with, and the frozen
value that later stages receive (the trainer's arguments, the routers' settings).

OmegaConf types a structured config from a plain (not frozen) dataclass whose mappings are ``dict``, and Python
lets neither a frozen dataclass derive from a plain one nor the other way round. So each set of fields is
declared here once, as a plain dataclass with ``Mapping`` where a value is a mapping; the Hydra schema derives
from it and narrows those mappings to ``dict`` (:class:`~miles_sglang_plugin.config.schema.MilesTrainerArgs`,
:class:`~miles_sglang_plugin.config.schema.RouterConf`), and the frozen value derives from it with
:class:`ReadOnlyFields` (:class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`,
:class:`~miles_sglang_plugin.rendering.router_specs.RouterSettings`). Names, order, defaults and docstrings are
therefore the same on both sides by construction; tests/test_schema.py fails if a subclass declares one of these
fields again other than to narrow a mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class ReadOnlyFields:
    """What ``frozen=True`` gives a dataclass, for one that derives from a plain dataclass (which a frozen one
    cannot): each field is set once, by ``__init__``; assigning to it again, or deleting it, raises
    :class:`dataclasses.FrozenInstanceError`. ``__post_init__`` replaces a value with ``object.__setattr__``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in vars(self) or name not in getattr(self, "__dataclass_fields__", {}):
            raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@dataclass
class TrainerFields:
    """The trainer's arguments under Miles' names (Miles' command-line arguments, one to one), declared once for
    the root schema and the frozen inputs of resolution."""

    hf_checkpoint: str | None = None
    """The trained model's checkpoint (Miles' --hf-checkpoint); the default model path of every model."""
    rollout_num_gpus: int | None = None
    """GPUs for rollout, eval excluded; null: whatever the server groups hold (set: must match them)."""
    rollout_num_gpus_per_engine: int = 1
    """GPUs per engine (TP x PP) of groups that pin none, in GPUs."""
    num_gpus_per_node: int = 8
    """GPUs of each node of the cluster."""
    actor_num_nodes: int = 1
    """Nodes the actor trains on (placement: rollout GPUs come after the actor's unless colocated)."""
    actor_num_gpus_per_node: int = 8
    """GPUs per node the actor trains on."""
    colocate: bool = False
    """Rollout shares the training GPUs (from slot 0; Miles sizes rollout to the actor's GPUs and offloads)."""
    offload_rollout: bool | None = None
    """Engines on training GPUs release their memory during training; null: on with colocate, else off."""
    eval_num_gpus: int = 0
    """GPUs of the separate eval fleet (a model named eval); 0: none."""
    eval_num_gpus_per_engine: int = 1
    """GPUs per engine of the eval fleet (Miles' default 1, whatever rollout_num_gpus_per_engine is)."""
    prefill_num_servers: int | None = None
    """Miles' legacy PD split without a deployment: prefill engines of the one model; null: none."""
    debug_rollout_only: bool = False
    """Rollout without training (no Megatron GPUs; rollout starts at slot 0)."""
    debug_train_only: bool = False
    """Training without rollout: no rollout engines (Miles sets rollout_num_gpus to 0); an eval fleet
    (eval_num_gpus > 0) still starts, alone, after the actor's GPUs."""
    use_critic: bool = False
    """A critic trains next to the actor (Miles gives it the actor's size, on the actor's GPUs)."""
    critic_train_only: bool = False
    """Only the critic trains (its GPUs come before rollout's)."""
    critic_num_nodes: int | None = None
    """Nodes the critic trains on; null: actor_num_nodes; 0: no critic (with use_critic: the actor's)."""
    critic_num_gpus_per_node: int | None = None
    """GPUs per node the critic trains on; null: actor_num_gpus_per_node; 0: no critic."""
    seed: int = 1234
    """Base of each engine's --random-seed (Miles: seed + the engine's rank)."""
    use_rollout_routing_replay: bool = False
    """Engines record MoE routing for replay in training (Miles' --use-rollout-routing-replay)."""
    use_rollout_indexer_replay: bool = False
    """Engines record the indexer's choices for replay in training (Miles' --use-rollout-indexer-replay)."""
    fp16: bool = False
    """Train in fp16 (engines then serve in float16)."""
    eval_sglang_overrides: Mapping[str, Any] = field(default_factory=dict)
    """Miles' --eval-sglang-* values for the eval fleet (ServerArgs field -> value)."""
    num_nodes: int | None = None
    """Nodes of the cluster, for the capacity check (not a Miles argument); null: unknown, not checked."""


@dataclass
class RouterFields:
    """The router settings of every model (sglang-router or SMG, the same settings for both), declared once for
    the schema's ``sglang_deploy.router`` and the frozen settings a router is launched with."""

    gateway: str = "auto"
    """Which gateway runs the routers: sglang_router (sglang-router 0.3.2), smg (SMG 1.13.0, the [smg] extra),
    or auto ($MSP_ROUTER_GATEWAY when set, else smg where it is installed, else sglang_router)."""
    policy: str = "cache_aware"
    """Load-balancing policy: cache_aware, round_robin, power_of_two, random, manual or consistent_hashing
    (SMG also: prefix_hash, least_load, passthrough)."""
    prefill_policy: str | None = None
    """Policy among a PD model's prefill engines (bucket allowed here); null: ``policy``."""
    decode_policy: str | None = None
    """Policy among a PD model's decode engines; null: ``policy``."""
    request_timeout_secs: int = 14400
    """Longest a request may take through the router, in seconds."""
    health_check_interval_secs: int = 60
    """Time between the router's health checks of a worker, in seconds."""
    health_failure_threshold: int = 3
    """Failed health checks in a row after which the router takes a worker out."""
    health_success_threshold: int = 2
    """Passed health checks in a row after which the router takes a worker back."""
    health_check_timeout_secs: int = 5
    """Time a health check may take, in seconds."""
    disable_health_check: bool = False
    """Turn the router's health checks off."""
    retry_max_retries: int = 5
    """Retries of a failed request on another worker."""
    disable_retries: bool = False
    """Turn request retries off."""
    retry_initial_backoff_ms: int = 50
    """Wait before the first retry of a request, in milliseconds (the router's default)."""
    retry_max_backoff_ms: int = 30000
    """Longest wait between retries of a request, in milliseconds."""
    retry_backoff_multiplier: float = 1.5
    """Factor the wait grows by from one retry to the next."""
    retry_jitter_factor: float = 0.2
    """Random share added to each wait (0.2: up to 20 %)."""
    cb_failure_threshold: int = 10
    """Failures in a row that open a worker's circuit breaker."""
    cb_timeout_duration_secs: int = 60
    """Time a worker's circuit breaker stays open, in seconds."""
    disable_circuit_breaker: bool | None = None
    """Turn the circuit breaker off; null: off for a PD router, on for a regular one. A PD router counts a
    failed request against both workers of its pair, so one engine that dies with requests in flight opens
    the circuit of every worker of the other kind, and the model answers 503 for ``cb_timeout_duration_secs``
    (slime turns it off for PD too); the deployment takes a dead engine out of its router itself."""
    log_level: str = "warn"
    """Router log level: debug, info, warn or error."""
    shutdown_grace_period_secs: int = 0
    """How long the router waits for requests in flight when it is stopped, in seconds (``RouterArgs``' own
    default is 180, and SMG waits about 5 s even with nothing in flight). A deployment stops its engines at the
    same moment, so nothing in flight could finish: 0 stops the router at once."""
    drain_settle_secs: int = 0
    """SMG only: how long a removed worker stays draining (listed, a new registration of its URL refused)
    before it goes, in seconds. SMG's own default, 5, is for a load balancer in front of it; these routers are
    reached directly, and a restarted engine is registered again at once. sglang-router removes at once."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Any other ``RouterArgs`` field of the gateway, by name (field -> value)."""
