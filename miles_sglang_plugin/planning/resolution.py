"""Resolution: a pure function from a deployment description plus trainer inputs to a frozen plan.

It follows Miles' rules exactly (``gpu_offset`` cursor, ``rollout_offset``, ``needs_offload``, the
``enable_memory_saver`` injection, ``update_weights`` inference, the eval fleet, legacy
``prefill_num_servers``), and is stricter where Miles silently misbehaves (GPUs that do not split into whole
engines, engines that straddle nodes, regular mixed with prefill/decode, prefill without decode, a deployment
larger than the cluster, several models receiving weight updates). Every problem is collected and reported at
once, as one :class:`~miles_sglang_plugin.errors.DeploymentConfigError`, before anything starts.
"""

from __future__ import annotations

import difflib
from collections.abc import Collection, Mapping
from typing import Any

from miles_sglang_plugin.config.deployment_spec import (
    NAME_RE,
    WORKER_TYPES,
    DeploymentSpec,
    GroupSpec,
    ModelSpec,
    WorkerType,
    freeze,
    is_int,
)
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.masking import MASK, SECRET_FIELDS
from miles_sglang_plugin.planning.plan import (
    DeploymentPlan,
    EnginePlan,
    EngineProcessPlan,
    GroupPlan,
    ModelPlan,
)

#: ServerArgs fields that the plan decides; a group override may not set them.
PLAN_OWNED_OVERRIDES: Mapping[str, str] = {
    "host": "the launcher binds each engine to its node's address",
    "port": "ports are assigned per engine so that none collide",
    "nccl_port": "ports are assigned per engine so that none collide",
    "dist_init_addr": "an engine's processes share one address chosen by the launcher",
    "base_gpu_id": "each engine sees only its own GPUs through CUDA_VISIBLE_DEVICES, with base_gpu_id 0",
    "gpu_id_step": "each engine's GPUs are contiguous",
    "nnodes": "follows from num_gpus_per_engine and num_gpus_per_node",
    "node_rank": "assigned per engine process",
    "disaggregation_bootstrap_port": "assigned per prefill engine so that none collide",
    "api_key": "it is a secret: set sglang_deploy.api_key (or SGLANG_API_KEY), which also reaches the routers",
    "admin_api_key": "it is a secret: pass it to the engines through sglang_deploy.env, not the config",
}

#: The eval fleet's lowest override layer (Miles ``_apply_eval_model_config``).
EVAL_DEFAULT_OVERRIDES: Mapping[str, Any] = {
    "enable_return_routed_experts": False,
    "enable_return_indexer_topk": False,
}
#: Also reset to 1 for eval groups whose TP differs from the rollout TP.
EVAL_PARALLEL_RESETS = ("dp_size", "pp_size", "ep_size", "attn_cp_size")


def suggest(name: str, candidates: Collection[str], n: int = 3) -> list[str]:
    """Close matches of ``name`` among ``candidates`` (``-`` and ``_`` treated alike)."""
    normalised = name.replace("-", "_")
    return difflib.get_close_matches(normalised, list(candidates), n=n, cutoff=0.6)


def normalise_overrides(overrides: Mapping[str, Any], key: str, problems: ProblemCollector) -> dict[str, Any]:
    """``-`` and ``_`` spellings are both accepted; both spellings of one field at once are an error."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in overrides.items():
        norm = str(raw_key).replace("-", "_")
        if norm in out:
            problems.add(
                f"{key}.overrides.{raw_key}",
                f"the same ServerArgs field as {spelled[norm]!r}; give it once",
            )
            continue
        out[norm] = value
        spelled[norm] = str(raw_key)
    return out


def legacy_spec(trainer: TrainerInputs, problems: ProblemCollector) -> DeploymentSpec:
    """The deployment Miles builds when no ``--sglang-config`` is given (``prefill_num_servers`` or one regular
    group), plus the eval model when ``eval_num_gpus`` > 0."""
    models: list[ModelSpec] = []
    total = trainer.rollout_num_gpus
    if total is None or total < 1:
        problems.add(
            "rollout_num_gpus",
            f"must be >= 1 when no sglang deployment is given (got {total!r}); set it, or choose a preset "
            "with sglang=<preset>",
        )
    elif trainer.prefill_num_servers is not None:
        prefill = trainer.prefill_num_servers * trainer.rollout_num_gpus_per_engine
        decode = total - prefill
        if decode <= 0:
            problems.add(
                "prefill_num_servers",
                f"{trainer.prefill_num_servers} prefill servers x {trainer.rollout_num_gpus_per_engine} GPUs "
                f"= {prefill} GPUs leave {decode} of rollout_num_gpus={total} for decode; decode needs >= 1",
            )
        else:
            models.append(
                ModelSpec(
                    name="default",
                    key="sglang.default",
                    groups=(
                        GroupSpec("prefill", WorkerType.prefill, prefill, key="sglang.default.prefill"),
                        GroupSpec("decode", WorkerType.decode, decode, key="sglang.default.decode"),
                    ),
                )
            )
    else:
        models.append(
            ModelSpec(
                name="default",
                key="sglang.default",
                groups=(GroupSpec("regular", WorkerType.regular, total, key="sglang.default.regular"),),
            )
        )
    if trainer.eval_num_gpus > 0:
        models.append(
            ModelSpec(
                name="eval",
                key="sglang.eval",
                groups=(
                    GroupSpec(
                        "regular", WorkerType.regular, trainer.eval_num_gpus, key="sglang.eval.regular"
                    ),
                ),
            )
        )
    return DeploymentSpec(models=tuple(models), source="trainer arguments")


class _Resolver:
    def __init__(
        self,
        spec: DeploymentSpec,
        trainer: TrainerInputs,
        problems: ProblemCollector,
        server_arg_fields: Collection[str] | None,
        server_defaults: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self.t = trainer
        self.problems = problems
        self.fields = frozenset(server_arg_fields) if server_arg_fields is not None else None
        self.defaults = normalise_overrides(server_defaults or {}, "sglang_deploy.server_defaults", problems)
        self.eval_overrides = normalise_overrides(
            trainer.eval_sglang_overrides, "eval_sglang_overrides", problems
        )
        self.cursor = 0
        self.rank = 0
        self.rollout_offset = trainer.rollout_offset
        self.megatron = trainer.megatron_num_gpus
        self.eval_active = trainer.eval_num_gpus > 0

    # -------------------------------------------------------------------------------------------- deployment
    def run(self) -> tuple[ModelPlan, ...]:
        p, t = self.problems, self.t
        names = [m.name for m in self.spec.models]
        for name in sorted({n for n in names if names.count(n) > 1}):
            p.add(
                f"sglang.{name}",
                f"model name {name!r} is used {names.count(name)} times; names must be unique",
            )
        if not self.spec.models:
            p.add("sglang", "no models: a deployment needs at least one model with at least one server group")

        evals = [m for m in self.spec.models if m.name == "eval"]
        if self.eval_active:
            if len(evals) != 1:
                p.add(
                    "sglang",
                    f"eval_num_gpus={t.eval_num_gpus} needs exactly one model named 'eval', found {len(evals)}; "
                    f"models: {names}",
                )
            else:
                eval_gpus = sum(g.num_gpus for g in evals[0].groups if is_int(g.num_gpus))
                if eval_gpus != t.eval_num_gpus:
                    p.add(
                        evals[0].key or "sglang.eval",
                        f"holds {eval_gpus} GPUs but eval_num_gpus={t.eval_num_gpus}; they must be equal",
                    )
            eval_gpe = t.effective_eval_num_gpus_per_engine
            if t.eval_num_gpus % eval_gpe:
                p.add(
                    "eval_num_gpus_per_engine",
                    f"eval_num_gpus={t.eval_num_gpus} does not split into engines of {eval_gpe} GPUs",
                )
            self.check_keys("eval_sglang_overrides", self.eval_overrides)
        elif t.eval_sglang_overrides:
            p.add(
                "eval_sglang_overrides",
                f"eval overrides {sorted(t.eval_sglang_overrides)} are set but eval_num_gpus is 0",
            )

        models = tuple(self.model(m) for m in self.spec.models)

        updatable = [m.name for m in models if m.update_weights]
        if len(updatable) > 1:
            p.add(
                "sglang",
                f"{len(updatable)} models receive weight updates ({', '.join(updatable)}); at most one may. "
                "Set update_weights: false on the frozen ones",
            )
        return models

    # ------------------------------------------------------------------------------------------------ model
    def model(self, m: ModelSpec) -> ModelPlan:
        p, t = self.problems, self.t
        key = m.key or f"sglang.{m.name}"
        is_eval = self.eval_active and m.name == "eval"
        if not isinstance(m.name, str) or not NAME_RE.match(m.name):
            p.add(
                key,
                f"model name {m.name!r} must start with a letter or '_' and hold only letters, digits, _ or -",
            )
        if m.num_gpus_per_engine is not None and (
            not is_int(m.num_gpus_per_engine) or m.num_gpus_per_engine < 1
        ):
            p.add(f"{key}.num_gpus_per_engine", f"must be an integer >= 1, got {m.num_gpus_per_engine!r}")
        if m.update_weights is not None and not isinstance(m.update_weights, bool):
            p.add(f"{key}.update_weights", f"must be true, false or null, got {m.update_weights!r}")
        if not m.groups:
            p.add(key, "has no server groups; give at least one group num_gpus > 0")

        group_names = [g.name for g in m.groups]
        for name in sorted({n for n in group_names if group_names.count(n) > 1}):
            p.add(
                f"{key}.{name}",
                f"group name {name!r} is used {group_names.count(name)} times in model {m.name!r}",
            )

        types = {str(g.worker_type) for g in m.groups}
        if "regular" in types and types & {"prefill", "decode"}:
            p.add(
                key,
                "mixes regular groups with prefill/decode groups; a model is either PD-disaggregated "
                "(prefill + decode) or regular. Put the regular engines in a model of their own",
            )
        if ("prefill" in types) != ("decode" in types):
            have, missing = ("prefill", "decode") if "prefill" in types else ("decode", "prefill")
            p.add(key, f"has {have} groups but no {missing} group; PD disaggregation needs both")

        model_level_path = m.model_path or t.hf_checkpoint
        groups = tuple(self.group(m, g, is_eval, model_level_path) for g in m.groups)

        serving = [g for g in groups if g.worker_type is not WorkerType.placeholder]
        paths = {g.name: g.overrides.get("model_path") for g in serving}
        distinct = {v for v in paths.values()}
        model_path = next(iter(distinct)) if len(distinct) == 1 else None
        if len(distinct) > 1:
            p.add(
                key,
                "all groups of a model must serve one model path, got "
                + ", ".join(f"{n}={v!r}" for n, v in paths.items())
                + "; define a separate model for a different checkpoint",
            )
        elif serving and model_path is None:
            p.add(f"{key}.model_path", "no model path: set it, or set the trainer's hf_checkpoint")

        if m.update_weights is not None:
            update_weights = bool(m.update_weights)
        elif is_eval:
            update_weights = False
        else:
            update_weights = model_path is not None and model_path == t.hf_checkpoint

        return ModelPlan(
            name=m.name,
            model_path=model_path or "",
            update_weights=update_weights,
            groups=groups,
            is_eval=is_eval,
        )

    # ------------------------------------------------------------------------------------------------ group
    def group(self, m: ModelSpec, g: GroupSpec, is_eval: bool, model_level_path: str | None) -> GroupPlan:
        p, t = self.problems, self.t
        key = g.key or f"sglang.{m.name}.{g.name}"

        worker_type: WorkerType | None
        try:
            worker_type = WorkerType(str(g.worker_type))
        except ValueError:
            p.add(
                f"{key}.worker_type",
                f"{g.worker_type!r} is not a worker type; valid: {', '.join(WORKER_TYPES)}",
            )
            worker_type = None

        num_gpus = g.num_gpus
        if not is_int(num_gpus) or num_gpus < 1:
            p.add(f"{key}.num_gpus", f"must be an integer >= 1, got {num_gpus!r}")
            num_gpus = 0

        if g.num_gpus_per_engine is not None:
            gpe, gpe_from = g.num_gpus_per_engine, f"{key}.num_gpus_per_engine"
        elif is_eval:
            gpe, gpe_from = t.effective_eval_num_gpus_per_engine, "eval_num_gpus_per_engine"
        elif m.num_gpus_per_engine is not None:
            gpe, gpe_from = m.num_gpus_per_engine, f"{m.key or 'sglang.' + m.name}.num_gpus_per_engine"
        else:
            gpe, gpe_from = t.rollout_num_gpus_per_engine, "rollout_num_gpus_per_engine"
        if not is_int(gpe) or gpe < 1:
            if gpe_from == f"{key}.num_gpus_per_engine":
                p.add(gpe_from, f"must be an integer >= 1, got {gpe!r}")
            gpe = 1

        user = normalise_overrides(g.overrides, key, p)
        gpu_offset = self.cursor
        self.cursor += num_gpus
        group_abs_start = self.rollout_offset + gpu_offset
        needs_offload = bool(t.offload_rollout and group_abs_start < self.megatron)

        # Override layers, lowest first; each remembers where it was written, for messages.
        layers: list[tuple[str, Mapping[str, Any]]] = [("sglang_deploy.server_defaults", self.defaults)]
        overrides: dict[str, Any] = {}
        if model_level_path is not None:
            overrides["model_path"] = model_level_path
        if t.offload_rollout and not needs_offload:
            overrides["enable_memory_saver"] = False
        if is_eval:
            eval_layer: dict[str, Any] = dict(EVAL_DEFAULT_OVERRIDES)
            if gpe != t.rollout_num_gpus_per_engine:
                eval_layer.update(dict.fromkeys(EVAL_PARALLEL_RESETS, 1))
            overrides.update(eval_layer)
            layers.append(("(eval fleet default)", eval_layer))
            overrides.update(self.eval_overrides)
            layers.append(("eval_sglang_overrides", self.eval_overrides))
        overrides.update(user)
        layers.append((f"{key}.overrides", user))

        engines: tuple[EnginePlan, ...] = ()
        sizes = {"tp_size": gpe, "pp_size": 1, "dp_size": 1}
        if worker_type is not None and worker_type is not WorkerType.placeholder and num_gpus:
            self.check_keys(f"{key}.overrides", user)
            sizes = self.check_parallel(layers, worker_type, gpe)
            engines = self.engines(m.name, g.name, key, worker_type, num_gpus, gpe, gpu_offset)

        return GroupPlan(
            name=g.name,
            worker_type=worker_type or WorkerType.regular,
            num_gpus=num_gpus,
            num_gpus_per_engine=gpe,
            tp_size=sizes["tp_size"],
            pp_size=sizes["pp_size"],
            dp_size=sizes["dp_size"],
            gpu_offset=gpu_offset,
            needs_offload=needs_offload,
            overrides=freeze(overrides),
            engines=engines,
            key=key,
        )

    def check_keys(self, where: str, values: Mapping[str, Any]) -> None:
        """Keys the plan owns, and keys that are not ServerArgs fields of the installed SGLang."""
        p = self.problems
        for name, reason in PLAN_OWNED_OVERRIDES.items():
            if name in values:
                shown = MASK if name in SECRET_FIELDS else repr(values[name])
                p.add(f"{where}.{name}", f"cannot be overridden ({shown}): {reason}")
        if self.fields is not None:
            for name in values:
                if name not in self.fields:
                    close = suggest(name, self.fields)
                    hint = f"; did you mean {', '.join(close)}?" if close else ""
                    p.add(f"{where}.{name}", f"is not a ServerArgs field of the installed SGLang{hint}")

    def check_parallel(
        self, layers: list[tuple[str, Mapping[str, Any]]], worker_type: WorkerType, gpe: int
    ) -> dict[str, int]:
        """The engine's tp/pp/dp sizes from all override layers, checked against num_gpus_per_engine."""
        p = self.problems

        def value(name: str, default: Any) -> tuple[Any, str]:
            for where, layer in reversed(layers):
                if name in layer:
                    return layer[name], f"{where}.{name}"
            return default, ""

        mode, where = value("disaggregation_mode", None)
        expected_mode = worker_type.value if worker_type.is_pd else "null"
        if mode is not None and str(mode) != expected_mode:
            p.add(
                where,
                f"{mode!r} contradicts worker_type {worker_type.value!r} (which implies {expected_mode!r}); "
                "set the worker type instead",
            )
        pp, where = value("pp_size", 1)
        if not is_int(pp) or pp < 1:
            p.add(where, f"must be an integer >= 1, got {pp!r}")
            pp = 1
        elif gpe % pp:
            p.add(where, f"{pp} does not divide num_gpus_per_engine={gpe}")
            pp = 1
        tp, where = value("tp_size", None)
        if tp is not None and tp != gpe // pp:
            p.add(
                where,
                f"{tp!r} disagrees with num_gpus_per_engine={gpe}"
                + (f" / pp_size={pp}" if pp > 1 else "")
                + f" (tp_size would be {gpe // pp}); set num_gpus_per_engine instead",
            )
        sizes = {"tp_size": gpe // pp, "pp_size": pp, "dp_size": 1}
        for name in ("dp_size", "ep_size"):
            v, where = value(name, 1)
            if not is_int(v) or v < 1 or v > gpe:
                p.add(where, f"must be an integer between 1 and num_gpus_per_engine={gpe}, got {v!r}")
            elif name == "dp_size":
                sizes["dp_size"] = v
        return sizes

    # ---------------------------------------------------------------------------------------------- engines
    def engines(
        self, model: str, group: str, key: str, wt: WorkerType, num_gpus: int, gpe: int, gpu_offset: int
    ) -> tuple[EnginePlan, ...]:
        p, gpn = self.problems, self.t.num_gpus_per_node
        if num_gpus % gpe:
            whole = num_gpus // gpe
            p.add(
                f"{key}.num_gpus",
                f"{num_gpus} GPUs do not split into engines of num_gpus_per_engine={gpe}: {whole} engine(s) "
                f"would leave {num_gpus - whole * gpe} GPU(s) idle; use a multiple of {gpe}",
            )
            return ()
        if gpe > gpn and gpe % gpn:
            p.add(
                f"{key}.num_gpus_per_engine",
                f"an engine of {gpe} GPUs is wider than a node of num_gpus_per_node={gpn} GPUs, so it must use "
                f"whole nodes (a multiple of {gpn})",
            )
            return ()
        engines = []
        reported = False
        for i in range(num_gpus // gpe):
            start = self.rollout_offset + gpu_offset + i * gpe
            slots = tuple(range(start, start + gpe))
            if not reported and gpe <= gpn and start // gpn != slots[-1] // gpn:
                p.add(
                    key,
                    f"engine {i} would take GPU slots {start}..{slots[-1]}, across the boundary of node "
                    f"{start // gpn} and node {slots[-1] // gpn} (num_gpus_per_node={gpn}); an engine must sit on "
                    f"one node. The group starts at slot {self.rollout_offset + gpu_offset} (rollout_offset="
                    f"{self.rollout_offset} + gpu_offset={gpu_offset}); resize or reorder the groups before it",
                )
                reported = True
            if not reported and gpe > gpn and start % gpn:
                p.add(
                    key,
                    f"engine {i} spans {gpe // gpn} nodes but starts at GPU slot {start}, in the middle of node "
                    f"{start // gpn}; a multi-node engine must start at a node boundary",
                )
                reported = True
            processes = []
            for rank, node_start in enumerate(range(start, start + gpe, min(gpe, gpn))):
                chunk = slots[node_start - start : node_start - start + min(gpe, gpn)]
                processes.append(
                    EngineProcessPlan(
                        node=chunk[0] // gpn,
                        node_rank=rank,
                        gpu_slots=chunk,
                        local_gpu_ids=tuple(s % gpn for s in chunk),
                    )
                )
            engines.append(
                EnginePlan(
                    model=model,
                    group=group,
                    index=i,
                    rank=self.rank,
                    worker_type=wt,
                    gpu_slots=slots,
                    processes=tuple(processes),
                )
            )
            self.rank += 1
        return tuple(engines)


def resolve_deployment(
    spec: DeploymentSpec | None,
    trainer: TrainerInputs,
    *,
    server_arg_fields: Collection[str] | None = None,
    server_defaults: Mapping[str, Any] | None = None,
) -> DeploymentPlan:
    """Resolve a deployment into a frozen plan, or raise one error that lists every problem.

    ``spec=None`` means no deployment was described: Miles' legacy behaviour (one regular group, or
    ``prefill_num_servers``, plus the eval fleet). ``server_arg_fields`` (the installed SGLang's ``ServerArgs``
    field names) turns on the check of override keys; without it override keys are not checked here.
    ``server_defaults`` (``sglang_deploy.server_defaults``, Miles' ``--sglang-*`` values) take part in each
    engine's tp/pp/dp sizes, below every override.
    """
    problems = ProblemCollector(spec.source if spec is not None else "trainer arguments")
    problems.extend(trainer.problems())
    problems.raise_if_any()

    if trainer.debug_train_only:
        return DeploymentPlan(
            models=(),
            trainer=trainer,
            total_gpus=0,
            rollout_num_gpus=0,
            rollout_offset=trainer.rollout_offset,
            megatron_num_gpus=trainer.megatron_num_gpus,
            source=spec.source if spec is not None else "trainer arguments",
            notes=("debug_train_only: no rollout engines are started",),
        )

    if spec is None:
        spec = legacy_spec(trainer, problems)
        problems.raise_if_any()
    elif trainer.prefill_num_servers is not None:
        problems.add(
            "prefill_num_servers",
            f"{trainer.prefill_num_servers} cannot be combined with an sglang deployment; describe prefill and "
            "decode groups in the deployment instead",
        )

    resolver = _Resolver(spec, trainer, problems, server_arg_fields, server_defaults)
    models = resolver.run()
    total = resolver.cursor

    rollout_num_gpus = total - trainer.eval_num_gpus
    if trainer.rollout_num_gpus is not None and trainer.rollout_num_gpus + trainer.eval_num_gpus != total:
        breakdown = ", ".join(f"{m.name}={m.num_gpus}" for m in models)
        problems.add(
            "rollout_num_gpus",
            f"is {trainer.rollout_num_gpus}"
            + (f" (+ eval_num_gpus={trainer.eval_num_gpus})" if trainer.eval_num_gpus else "")
            + f" but the server groups hold {total} GPUs ({breakdown}); make them equal, or leave "
            "rollout_num_gpus unset to follow the groups",
        )
    elif rollout_num_gpus < 0:
        problems.add("eval_num_gpus", f"{trainer.eval_num_gpus} exceeds the {total} GPUs of the deployment")

    if trainer.num_nodes is not None:
        capacity = trainer.num_nodes * trainer.num_gpus_per_node
        needed = max(resolver.rollout_offset + total, trainer.megatron_num_gpus)
        if needed > capacity:
            problems.add(
                "num_nodes",
                f"the deployment needs {needed} GPU slots (rollout_offset={resolver.rollout_offset} + {total} "
                f"rollout GPUs) but the cluster has num_nodes={trainer.num_nodes} x num_gpus_per_node="
                f"{trainer.num_gpus_per_node} = {capacity}",
            )

    problems.raise_if_any()
    return DeploymentPlan(
        models=models,
        trainer=trainer,
        total_gpus=total,
        rollout_num_gpus=rollout_num_gpus,
        rollout_offset=resolver.rollout_offset,
        megatron_num_gpus=trainer.megatron_num_gpus,
        source=spec.source,
    )
