"""The members of a running deployment: its engines (started here, or external) with what the plan decided for
each (offload, weight updates, LoRA), their processes and live state; and the view the trainer gets of one,
:class:`EngineInfo`.

States of an engine: ``starting`` (processes started, not answering its health endpoint yet), ``healthy``
(answers it), ``registered`` (with its model's router: serving), ``lost`` (exited or stopped answering:
removed from its router), ``restarting`` (being started again with its same argv, environment and GPUs),
``failed`` (could not be brought back), ``stopped`` (the deployment stopped). External engines are never
started or stopped here: they are ``registered`` or ``lost`` (unreachable, out of the router until they answer
again).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from miles_sglang_plugin.backends.base import EngineProcess
from miles_sglang_plugin.planning.plan import ExternalEnginePlan, GroupPlan, ModelPlan
from miles_sglang_plugin.rendering.launch_specs import EngineProcessLaunch
from miles_sglang_plugin.rendering.prepared import PreparedDeployment
from miles_sglang_plugin.rendering.router_specs import WorkerRegistration

#: The group name external engines are listed under.
EXTERNAL_GROUP = "external"
#: Engine states in which it serves requests through its router.
SERVING_STATES = frozenset({"registered"})
#: States of an engine that is down for now and being brought back (control calls skip it and it gets the
#: deployment's control state replayed when it is back).
AWAY_STATES = frozenset({"lost", "restarting"})


@dataclass(frozen=True)
class EngineInfo:
    """One engine of a running deployment, as the trainer sees it."""

    id: str
    model: str
    group: str
    worker_type: str
    url: str
    #: The node of its first process (None for an external engine: not placed by this deployment).
    node: int | None
    #: The engine's ``CUDA_VISIBLE_DEVICES`` on its first node ("" for an external engine).
    gpus: str
    nnodes: int
    #: See the module docstring: starting, healthy, registered, lost, restarting, failed, stopped.
    state: str
    #: ``time.monotonic()`` when its current processes were started, and when it (last) answered its health
    #: endpoint for the first time.
    started_at: float | None = None
    healthy_at: float | None = None
    #: Runs elsewhere: never started or stopped by the deployment.
    external: bool = False
    #: GPUs of the whole engine (all nodes; for an external engine, its tp_size * pp_size as it reports them).
    num_gpus: int = 0
    #: How often it was restarted after a loss.
    restarts: int = 0
    #: What the plan decided for its group and model: takes part in offload/onload; receives weight updates.
    needs_offload: bool = False
    update_weights: bool = False
    #: Serves LoRA adapters (``--enable-lora``).
    serves_lora: bool = False


@dataclass
class EngineMember:
    """One engine of the deployment with its live state (internal: the trainer sees :class:`EngineInfo`)."""

    id: str
    model: str
    group: str
    worker_type: str
    url: str
    node: int | None
    gpus: str
    nnodes: int
    num_gpus: int
    needs_offload: bool
    update_weights: bool
    serves_lora: bool
    registration: WorkerRegistration
    #: Its processes' launches, node rank 0 first (empty for an external engine).
    launches: tuple[EngineProcessLaunch, ...] = ()
    external: bool = False
    processes: list[EngineProcess] = field(default_factory=list)
    state: str = "starting"
    healthy_at: float | None = None
    registered: bool = False
    restarts: int = 0
    #: Restarts counted against ``supervision.max_restarts`` (given back after a long healthy stretch).
    restarts_in_budget: int = 0
    #: ``time.monotonic()`` when it last came back from a restart.
    recovered_at: float | None = None
    #: Health polls failed in a row.
    health_failures: int = 0
    #: Held by the supervisor while it gives a restarted engine the control state and lets it serve;
    #: ``catching_up`` (changed under the control state's lock) says it is doing so.
    catch_up: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    catching_up: bool = False

    @property
    def lead(self) -> EngineProcessLaunch | None:
        return self.launches[0] if self.launches else None

    @property
    def serving(self) -> bool:
        return self.state in SERVING_STATES

    @property
    def away(self) -> bool:
        return self.state in AWAY_STATES

    def info(self) -> EngineInfo:
        return EngineInfo(
            id=self.id,
            model=self.model,
            group=self.group,
            worker_type=self.worker_type,
            url=self.url,
            node=self.node,
            gpus=self.gpus,
            nnodes=self.nnodes,
            state=self.state,
            started_at=self.processes[0].started_at if self.processes else None,
            healthy_at=self.healthy_at,
            external=self.external,
            num_gpus=self.num_gpus,
            restarts=self.restarts,
            needs_offload=self.needs_offload,
            update_weights=self.update_weights,
            serves_lora=self.serves_lora,
        )


def _local_member(
    model: ModelPlan, group: GroupPlan, launches: Sequence[EngineProcessLaunch], num_gpus: int
) -> EngineMember:
    lead = launches[0]
    return EngineMember(
        id=lead.engine_id,
        model=model.name,
        group=group.name,
        worker_type=lead.worker_type.value,
        url=lead.url,
        node=lead.node,
        gpus=lead.env.get("CUDA_VISIBLE_DEVICES", ""),
        nnodes=lead.nnodes,
        num_gpus=num_gpus,
        needs_offload=group.needs_offload,
        update_weights=model.update_weights,
        serves_lora=bool(lead.server_args.get("enable_lora")),
        registration=WorkerRegistration(
            url=lead.url,
            worker_type=lead.worker_type.value,
            bootstrap_port=lead.bootstrap_port if lead.worker_type.value == "prefill" else None,
        ),
        launches=tuple(launches),
    )


def _external_member(model: ModelPlan, engine: ExternalEnginePlan) -> EngineMember:
    return EngineMember(
        id=engine.id,
        model=model.name,
        group=EXTERNAL_GROUP,
        worker_type=engine.worker_type.value,
        url=engine.url,
        node=None,
        gpus="",
        nnodes=1,
        num_gpus=0,  # learnt from the engine's /server_info once it answers
        needs_offload=False,  # holds no GPU of the deployment: never offloaded (as in slime)
        update_weights=model.update_weights,
        serves_lora=False,  # learnt from its /server_info
        registration=WorkerRegistration(
            url=engine.url, worker_type=engine.worker_type.value, bootstrap_port=engine.bootstrap_port
        ),
        external=True,
    )


def build_members(prepared: PreparedDeployment) -> list[EngineMember]:
    """Every engine of ``prepared`` in deployment order (per model: its groups' engines, then its external
    engines), with its launches and the plan's decisions."""
    members: list[EngineMember] = []
    for model in prepared.plan.models:
        for group in model.groups:
            for engine in group.engines:
                launches = sorted(prepared.launch.for_engine(engine.id), key=lambda p: p.node_rank)
                members.append(_local_member(model, group, launches, engine.num_gpus))
        members += [_external_member(model, engine) for engine in model.external]
    return members
