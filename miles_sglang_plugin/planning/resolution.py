"""Resolution: a pure function from a deployment description plus trainer inputs to a frozen plan.

It follows Miles' rules exactly (``gpu_offset`` cursor, ``rollout_offset``, ``needs_offload``, the
``enable_memory_saver`` injection, ``update_weights`` inference, the eval fleet, legacy
``prefill_num_servers``), and is stricter where Miles silently misbehaves (GPUs that do not split into whole
engines, engines that straddle nodes, regular mixed with prefill/decode, prefill without decode, a deployment
larger than the cluster, several models receiving weight updates). Every problem is collected and reported at
once, as one :class:`~miles_sglang_plugin.errors.DeploymentConfigError`, before anything starts.
"""

from __future__ import annotations

import dataclasses
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
    thaw,
)
from miles_sglang_plugin.config.trainer_inputs import TrainerInputs
from miles_sglang_plugin.errors import ProblemCollector
from miles_sglang_plugin.masking import MASK, SECRET_FIELDS
from miles_sglang_plugin.planning.external import external_engine_plans
from miles_sglang_plugin.planning.miles_rules import (
    MilesDerivation,
    apply_miles_rules,
    megatron_num_gpus,
    rollout_offset,
)
from miles_sglang_plugin.planning.plan import (
    DeploymentPlan,
    EnginePlan,
    EngineProcessPlan,
    GroupPlan,
    ModelPlan,
)
from miles_sglang_plugin.planning.plan_notes import advisory_notes

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
    "gated_launch_port": "the launcher opens no launch gate: an engine given one would block at start-up until "
    "POST /gate/activate, which nothing sends (and each engine would need a port of its own)",
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


def normalise_overrides(
    overrides: Mapping[str, Any], where: str, problems: ProblemCollector
) -> dict[str, Any]:
    """``-`` and ``_`` spellings are both accepted; both spellings of one field at once are an error, reported
    at ``where`` (the key of the mapping itself: ``sglang.<model>.<group>.overrides``,
    ``sglang_deploy.server_defaults``, ``eval_sglang_overrides``) + the second spelling."""
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for raw_key, value in overrides.items():
        norm = str(raw_key).replace("-", "_")
        if norm in out:
            problems.add(
                f"{where}.{raw_key}",
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
    if total == 0:
        pass  # no rollout engines (debug_train_only, or 0 given; newer Miles: the eval fleet, if any, alone)
    elif total is None or total < 1:
        problems.add(
            "rollout_num_gpus",
            f"must be >= 0 when no sglang deployment is given (got {total!r}); set it, or choose a preset "
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


#: Where the deployment-wide server defaults are written, for messages.
SERVER_DEFAULTS_KEY = "sglang_deploy.server_defaults"

#: An override layer: where it was written (for messages) and its values.
OverrideLayer = tuple[str, Mapping[str, Any]]


def dp_attention(layers: list[OverrideLayer]) -> bool:
    """Whether the engine runs DP attention: ``enable_dp_attention`` true (Miles' ``--sglang-enable-dp-attention``),
    or SGLang 0.5.23's ``attn_dp_size`` > 1 (what resolution turns the former into)."""
    enabled, _ = _layered_value(layers, "enable_dp_attention", False)
    width, _ = _layered_value(layers, "attn_dp_size", 1)
    return enabled is True or str(enabled).lower() == "true" or (is_int(width) and width > 1)


def _layered_value(layers: list[OverrideLayer], name: str, default: Any) -> tuple[Any, str]:
    """The value of ``name`` in the highest layer that sets it, and where that is (``default`` and "" when no
    layer sets it)."""
    for where, layer in reversed(layers):
        if name in layer:
            return layer[name], f"{where}.{name}"
    return default, ""


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
        self.trainer = trainer
        self.problems = problems
        self.fields = frozenset(server_arg_fields) if server_arg_fields is not None else None
        self.defaults = normalise_overrides(server_defaults or {}, SERVER_DEFAULTS_KEY, problems)
        self.eval_overrides = normalise_overrides(
            trainer.eval_sglang_overrides, "eval_sglang_overrides", problems
        )
        self.cursor = 0
        self.rank = 0
        self.rollout_offset = rollout_offset(trainer)
        self.megatron = megatron_num_gpus(trainer)
        self.eval_active = trainer.eval_num_gpus > 0
        #: External engine URL -> where it was written (each engine may be given once).
        self.external_urls: dict[str, str] = {}

    # -------------------------------------------------------------------------------------------- deployment
    def run(self) -> tuple[ModelPlan, ...]:
        self.check_model_names()
        if self.eval_active:
            self.check_eval_fleet()
        models = tuple(self.model_plan(model) for model in self.spec.models)
        self.check_weight_updates(models)
        return models

    def check_model_names(self) -> None:
        names = [model.name for model in self.spec.models]
        for name in sorted({n for n in names if names.count(n) > 1}):
            self.problems.add(
                f"sglang.{name}",
                f"model name {name!r} is used {names.count(name)} times; names must be unique",
            )
        if not self.spec.models:
            self.problems.add(
                "sglang", "no models: a deployment needs at least one model with at least one server group"
            )

    def check_eval_fleet(self) -> None:
        """Exactly one model ``eval``, of ``eval_num_gpus`` GPUs in whole engines; eval override keys."""
        trainer = self.trainer
        evals = [model for model in self.spec.models if model.name == "eval"]
        if len(evals) != 1:
            names = [model.name for model in self.spec.models]
            self.problems.add(
                "sglang",
                f"eval_num_gpus={trainer.eval_num_gpus} needs exactly one model named 'eval', "
                f"found {len(evals)}; models: {names}",
            )
        else:
            eval_gpus = sum(group.num_gpus for group in evals[0].groups if is_int(group.num_gpus))
            if eval_gpus != trainer.eval_num_gpus:
                self.problems.add(
                    evals[0].key or "sglang.eval",
                    f"holds {eval_gpus} GPUs but eval_num_gpus={trainer.eval_num_gpus}; they must be equal",
                )
        eval_gpus_per_engine = trainer.eval_num_gpus_per_engine
        if trainer.eval_num_gpus % eval_gpus_per_engine:
            self.problems.add(
                "eval_num_gpus_per_engine",
                f"eval_num_gpus={trainer.eval_num_gpus} does not split into engines of "
                f"{eval_gpus_per_engine} GPUs",
            )
        self.check_keys("eval_sglang_overrides", self.eval_overrides)

    def check_weight_updates(self, models: tuple[ModelPlan, ...]) -> None:
        updatable = [model.name for model in models if model.update_weights]
        if len(updatable) > 1:
            self.problems.add(
                "sglang",
                f"{len(updatable)} models receive weight updates ({', '.join(updatable)}); at most one may. "
                "Set update_weights: false on the frozen ones",
            )

    # ------------------------------------------------------------------------------------------------ model
    def model_plan(self, model: ModelSpec) -> ModelPlan:
        key = model.key or f"sglang.{model.name}"
        is_eval = self.eval_active and model.name == "eval"
        self.check_model_fields(model, key)
        self.check_worker_types(model, key)
        model_level_path = model.model_path or self.trainer.hf_checkpoint
        groups = tuple(self.group_plan(model, group, is_eval, model_level_path) for group in model.groups)
        external = external_engine_plans(model.name, model.external, self.external_urls, self.problems)
        model_path = self.served_model_path(groups, key)
        if model_path is None and not any(g.engines for g in groups) and external:
            model_path = model_level_path  # what its external engines are taken to serve
        return ModelPlan(
            name=model.name,
            model_path=model_path or "",
            update_weights=self.update_weights(model, is_eval, model_path),
            groups=groups,
            is_eval=is_eval,
            external=external,
        )

    def check_model_fields(self, model: ModelSpec, key: str) -> None:
        """The model's name, ``num_gpus_per_engine`` and ``update_weights``; its groups, uniquely named."""
        problems = self.problems
        if not isinstance(model.name, str) or not NAME_RE.match(model.name):
            problems.add(
                key,
                f"model name {model.name!r} must start with a letter or '_' and hold only letters, digits, "
                "_ or -",
            )
        if model.num_gpus_per_engine is not None and (
            not is_int(model.num_gpus_per_engine) or model.num_gpus_per_engine < 1
        ):
            problems.add(
                f"{key}.num_gpus_per_engine", f"must be an integer >= 1, got {model.num_gpus_per_engine!r}"
            )
        if model.update_weights is not None and not isinstance(model.update_weights, bool):
            problems.add(
                f"{key}.update_weights", f"must be true, false or null, got {model.update_weights!r}"
            )
        if not model.groups and not model.external:
            problems.add(
                key,
                "has no server groups and no external engines; give a group num_gpus > 0, or point the model at "
                f"engines that already run with {key}.external=[http://HOST:PORT, ...]",
            )
        group_names = [group.name for group in model.groups]
        for name in sorted({n for n in group_names if group_names.count(n) > 1}):
            problems.add(
                f"{key}.{name}",
                f"group name {name!r} is used {group_names.count(name)} times in model {model.name!r}",
            )

    def check_worker_types(self, model: ModelSpec, key: str) -> None:
        """Regular or PD-disaggregated (prefill and decode both), never mixed."""
        types = {str(group.worker_type) for group in model.groups} | {
            str(e.worker_type) for e in model.external
        }
        if "regular" in types and types & {"prefill", "decode"}:
            self.problems.add(
                key,
                "mixes regular groups with prefill/decode groups; a model is either PD-disaggregated "
                "(prefill + decode) or regular. Put the regular engines in a model of their own",
            )
        if ("prefill" in types) != ("decode" in types):
            have, missing = ("prefill", "decode") if "prefill" in types else ("decode", "prefill")
            self.problems.add(key, f"has {have} groups but no {missing} group; PD disaggregation needs both")

    def served_model_path(self, groups: tuple[GroupPlan, ...], key: str) -> str | None:
        """The one model path that every serving group serves (None when there is none, or several)."""
        serving = [group for group in groups if group.worker_type is not WorkerType.placeholder]
        paths = {group.name: group.overrides.get("model_path") for group in serving}
        distinct = set(paths.values())
        model_path = next(iter(distinct)) if len(distinct) == 1 else None
        if len(distinct) > 1:
            self.problems.add(
                key,
                "all groups of a model must serve one model path, got "
                + ", ".join(f"{name}={path!r}" for name, path in paths.items())
                + "; define a separate model for a different checkpoint",
            )
        elif serving and model_path is None:
            self.problems.add(
                f"{key}.model_path", "no model path: set it, or set the trainer's hf_checkpoint"
            )
        return model_path

    def update_weights(self, model: ModelSpec, is_eval: bool, model_path: str | None) -> bool:
        """As given; else false for the eval fleet; else whether the model serves the trainer's checkpoint."""
        if model.update_weights is not None:
            return bool(model.update_weights)
        if is_eval:
            return False
        return model_path is not None and model_path == self.trainer.hf_checkpoint

    # ------------------------------------------------------------------------------------------------ group
    def group_plan(
        self, model: ModelSpec, group: GroupSpec, is_eval: bool, model_level_path: str | None
    ) -> GroupPlan:
        key = group.key or f"sglang.{model.name}.{group.name}"
        worker_type = self.worker_type(group, key)
        num_gpus = self.group_num_gpus(group, key)
        gpus_per_engine = self.gpus_per_engine(model, group, key, is_eval)
        user = normalise_overrides(group.overrides, f"{key}.overrides", self.problems)
        gpu_offset, rank_offset = self.cursor, self.rank
        self.cursor += num_gpus
        self.rank += num_gpus // min(gpus_per_engine, self.trainer.num_gpus_per_node)
        needs_offload = bool(
            self.trainer.offload_rollout and self.rollout_offset + gpu_offset < self.megatron
        )
        layers = self.override_layers(key, user, is_eval)
        overrides = self.injected_overrides(model_level_path, needs_offload)
        for _, layer in layers:
            overrides.update(layer)
        self.check_model_path(overrides.get("model_path"), layers, model)

        engines: tuple[EnginePlan, ...] = ()
        sizes = {"tp_size": gpus_per_engine, "pp_size": 1, "dp_size": 1}
        all_layers = [(SERVER_DEFAULTS_KEY, self.defaults), *layers]
        attention = False
        if worker_type is not None and worker_type is not WorkerType.placeholder and num_gpus:
            self.check_keys(f"{key}.overrides", user)
            sizes = self.check_parallel(all_layers, worker_type, gpus_per_engine)
            attention = dp_attention(all_layers)
            engines = self.engine_plans(
                model.name, group.name, key, worker_type, (num_gpus, gpus_per_engine), gpu_offset, rank_offset
            )

        return GroupPlan(
            name=group.name,
            worker_type=worker_type or WorkerType.regular,
            num_gpus=num_gpus,
            num_gpus_per_engine=gpus_per_engine,
            tp_size=sizes["tp_size"],
            pp_size=sizes["pp_size"],
            dp_size=sizes["dp_size"],
            gpu_offset=gpu_offset,
            needs_offload=needs_offload,
            overrides=freeze(overrides),
            engines=engines,
            key=key,
            dp_attention=attention,
        )

    def worker_type(self, group: GroupSpec, key: str) -> WorkerType | None:
        try:
            return WorkerType(str(group.worker_type))
        except ValueError:
            self.problems.add(
                f"{key}.worker_type",
                f"{group.worker_type!r} is not a worker type; valid: {', '.join(WORKER_TYPES)}",
            )
            return None

    def group_num_gpus(self, group: GroupSpec, key: str) -> int:
        if not is_int(group.num_gpus) or group.num_gpus < 1:
            self.problems.add(f"{key}.num_gpus", f"must be an integer >= 1, got {group.num_gpus!r}")
            return 0
        return group.num_gpus

    def gpus_per_engine(self, model: ModelSpec, group: GroupSpec, key: str, is_eval: bool) -> int:
        """Group -> model (the eval fleet: ``eval_num_gpus_per_engine``) -> the trainer's
        ``rollout_num_gpus_per_engine``."""
        trainer = self.trainer
        group_key = f"{key}.num_gpus_per_engine"
        if group.num_gpus_per_engine is not None:
            value, given_at = group.num_gpus_per_engine, group_key
        elif is_eval:
            value, given_at = trainer.eval_num_gpus_per_engine, "eval_num_gpus_per_engine"
        elif model.num_gpus_per_engine is not None:
            value, given_at = (
                model.num_gpus_per_engine,
                f"{model.key or 'sglang.' + model.name}.num_gpus_per_engine",
            )
        else:
            value, given_at = trainer.rollout_num_gpus_per_engine, "rollout_num_gpus_per_engine"
        if not is_int(value) or value < 1:
            if given_at == group_key:
                self.problems.add(given_at, f"must be an integer >= 1, got {value!r}")
            value = 1
        return value

    def override_layers(self, key: str, user: Mapping[str, Any], is_eval: bool) -> list[OverrideLayer]:
        """The override layers above the server defaults, lowest first: the eval fleet's defaults and
        ``eval_sglang_overrides`` (eval only), then the group's own. Like Miles, the dp/pp/ep/attn_cp reset
        follows the trainer's arguments (``eval_num_gpus_per_engine`` against ``rollout_num_gpus_per_engine``),
        not the group's own engine size."""
        layers: list[OverrideLayer] = []
        if is_eval:
            eval_layer: dict[str, Any] = dict(EVAL_DEFAULT_OVERRIDES)
            if self.trainer.eval_num_gpus_per_engine != self.trainer.rollout_num_gpus_per_engine:
                eval_layer.update(dict.fromkeys(EVAL_PARALLEL_RESETS, 1))
            layers.append(("(eval fleet default)", eval_layer))
            layers.append(("eval_sglang_overrides", self.eval_overrides))
        layers.append((f"{key}.overrides", user))
        return layers

    def injected_overrides(self, model_level_path: str | None, needs_offload: bool) -> dict[str, Any]:
        """What the plan injects below every override layer: the model path, and the memory saver off for
        groups that need no offload."""
        overrides: dict[str, Any] = {}
        if model_level_path is not None:
            overrides["model_path"] = model_level_path
        if self.trainer.offload_rollout and not needs_offload:
            overrides["enable_memory_saver"] = False
        return overrides

    def check_model_path(self, path: Any, layers: list[OverrideLayer], model: ModelSpec) -> None:
        """The path a group serves is a string (a checkpoint directory or a hub name), wherever it was set."""
        if path is None or isinstance(path, str):
            return
        _value, where = _layered_value(layers, "model_path", None)
        if not where:
            where = (
                f"{model.key or 'sglang.' + model.name}.model_path" if model.model_path else "hf_checkpoint"
            )
        self.problems.add(where, f"must be a string (a checkpoint path or hub name), got {thaw(path)!r}")

    def check_keys(self, where: str, values: Mapping[str, Any]) -> None:
        """Keys the plan owns, and keys that are not ServerArgs fields of the installed SGLang."""
        for name, reason in PLAN_OWNED_OVERRIDES.items():
            if name in values:
                shown = MASK if name in SECRET_FIELDS else repr(values[name])
                self.problems.add(f"{where}.{name}", f"cannot be overridden ({shown}): {reason}")
        if self.fields is not None:
            for name in values:
                if name not in self.fields:
                    close = suggest(name, self.fields)
                    hint = f"; did you mean {', '.join(close)}?" if close else ""
                    self.problems.add(
                        f"{where}.{name}", f"is not a ServerArgs field of the installed SGLang{hint}"
                    )

    def check_parallel(
        self, layers: list[OverrideLayer], worker_type: WorkerType, gpus_per_engine: int
    ) -> dict[str, int]:
        """The engine's tp/pp/dp sizes from all override layers, checked against num_gpus_per_engine."""
        problems = self.problems
        mode, where = _layered_value(layers, "disaggregation_mode", None)
        expected_mode = worker_type.value if worker_type.is_pd else "null"
        if mode is not None and str(mode) != expected_mode:
            problems.add(
                where,
                f"{mode!r} contradicts worker_type {worker_type.value!r} (which implies {expected_mode!r}); "
                "set the worker type instead",
            )
        pp_size = self.pipeline_size(layers, gpus_per_engine)
        tp_size, where = _layered_value(layers, "tp_size", None)
        if tp_size is not None and tp_size != gpus_per_engine // pp_size:
            problems.add(
                where,
                f"{tp_size!r} disagrees with num_gpus_per_engine={gpus_per_engine}"
                + (f" / pp_size={pp_size}" if pp_size > 1 else "")
                + f" (tp_size would be {gpus_per_engine // pp_size}); set num_gpus_per_engine instead",
            )
        sizes = {"tp_size": gpus_per_engine // pp_size, "pp_size": pp_size, "dp_size": 1}
        for name in ("dp_size", "ep_size"):
            value, where = _layered_value(layers, name, 1)
            if not is_int(value) or value < 1 or value > gpus_per_engine:
                problems.add(
                    where,
                    f"must be an integer between 1 and num_gpus_per_engine={gpus_per_engine}, got {value!r}",
                )
            elif name == "dp_size":
                sizes["dp_size"] = value
                self.check_dp_attention(layers, value, where, sizes)
        return sizes

    def check_dp_attention(
        self, layers: list[OverrideLayer], dp_size: int, where: str, sizes: dict[str, int]
    ) -> None:
        """``dp_size`` > 1 needs DP attention, as Miles and slime require (``validate_args``: ``assert
        args.sglang_enable_dp_attention`` when ``--sglang-dp-size`` > 1): without it SGLang runs ``dp_size``
        replicas of the engine's TP, ``dp_size`` times the GPUs the group gives it."""
        if dp_size <= 1 or dp_attention(layers):
            return
        tp_size, pp_size = sizes["tp_size"], sizes["pp_size"]
        self.problems.add(
            where,
            f"{dp_size} needs DP attention (enable_dp_attention: true), as Miles and slime require: without it "
            f"SGLang runs {dp_size} data-parallel replicas of tp_size={tp_size}"
            + (f" x pp_size={pp_size}" if pp_size > 1 else "")
            + f", {dp_size * tp_size * pp_size} GPUs, in an engine of num_gpus_per_engine={tp_size * pp_size}",
        )

    def pipeline_size(self, layers: list[OverrideLayer], gpus_per_engine: int) -> int:
        """``pp_size`` from the layers (1 when unset or wrong)."""
        pp_size, where = _layered_value(layers, "pp_size", 1)
        if not is_int(pp_size) or pp_size < 1:
            self.problems.add(where, f"must be an integer >= 1, got {pp_size!r}")
            return 1
        if gpus_per_engine % pp_size:
            self.problems.add(where, f"{pp_size} does not divide num_gpus_per_engine={gpus_per_engine}")
            return 1
        return pp_size

    # ---------------------------------------------------------------------------------------------- engines
    def engine_plans(
        self,
        model: str,
        group: str,
        key: str,
        worker_type: WorkerType,
        sizes: tuple[int, int],
        gpu_offset: int,
        rank_offset: int,
    ) -> tuple[EnginePlan, ...]:
        """The group's engines; engine ``i``'s first process has Miles' rank ``rank_offset + i * nnodes``."""
        num_gpus, gpus_per_engine = sizes
        if not self.engines_fit(key, num_gpus, gpus_per_engine):
            return ()
        engines = []
        reported = False
        nnodes = max(1, gpus_per_engine // self.trainer.num_gpus_per_node)
        for i in range(num_gpus // gpus_per_engine):
            start = self.rollout_offset + gpu_offset + i * gpus_per_engine
            slots = tuple(range(start, start + gpus_per_engine))
            if not reported:
                reported = self.check_engine_placement(key, i, slots, gpu_offset)
            rank = rank_offset + i * nnodes
            engines.append(
                EnginePlan(
                    model=model,
                    group=group,
                    index=i,
                    rank=rank,
                    worker_type=worker_type,
                    gpu_slots=slots,
                    processes=self.engine_processes(slots, rank),
                )
            )
        return tuple(engines)

    def engines_fit(self, key: str, num_gpus: int, gpus_per_engine: int) -> bool:
        """Whether the group's GPUs split into whole engines, and an engine wider than a node takes whole
        nodes."""
        gpus_per_node = self.trainer.num_gpus_per_node
        if num_gpus % gpus_per_engine:
            whole = num_gpus // gpus_per_engine
            self.problems.add(
                f"{key}.num_gpus",
                f"{num_gpus} GPUs do not split into engines of num_gpus_per_engine={gpus_per_engine}: "
                f"{whole} engine(s) would leave {num_gpus - whole * gpus_per_engine} GPU(s) idle; "
                f"use a multiple of {gpus_per_engine}",
            )
            return False
        if gpus_per_engine > gpus_per_node and gpus_per_engine % gpus_per_node:
            self.problems.add(
                f"{key}.num_gpus_per_engine",
                f"an engine of {gpus_per_engine} GPUs is wider than a node of num_gpus_per_node={gpus_per_node} "
                f"GPUs, so it must use whole nodes (a multiple of {gpus_per_node})",
            )
            return False
        return True

    def check_engine_placement(self, key: str, index: int, slots: tuple[int, ...], gpu_offset: int) -> bool:
        """Whether engine ``index`` of a group is misplaced (reported): across a node boundary, or a multi-node
        engine that does not start at one."""
        gpus_per_node = self.trainer.num_gpus_per_node
        start, last = slots[0], slots[-1]
        if len(slots) <= gpus_per_node and start // gpus_per_node != last // gpus_per_node:
            self.problems.add(
                key,
                f"engine {index} would take GPU slots {start}..{last}, across the boundary of node "
                f"{start // gpus_per_node} and node {last // gpus_per_node} (num_gpus_per_node={gpus_per_node}); "
                f"an engine must sit on one node. The group starts at slot {self.rollout_offset + gpu_offset} "
                f"(rollout_offset={self.rollout_offset} + gpu_offset={gpu_offset}); resize or reorder the groups "
                "before it",
            )
            return True
        if len(slots) > gpus_per_node and start % gpus_per_node:
            self.problems.add(
                key,
                f"engine {index} spans {len(slots) // gpus_per_node} nodes but starts at GPU slot {start}, in the "
                f"middle of node {start // gpus_per_node}; a multi-node engine must start at a node boundary",
            )
            return True
        return False

    def engine_processes(self, slots: tuple[int, ...], rank: int) -> tuple[EngineProcessPlan, ...]:
        """One process per node the engine's GPU slots are on (one in all for an engine within a node); the
        process of node rank k has Miles' rank ``rank + k``."""
        gpus_per_node = self.trainer.num_gpus_per_node
        if len(slots) <= gpus_per_node:  # within one node: one process (most engines; no chunks to make)
            node = slots[0] // gpus_per_node
            local = tuple(slot - node * gpus_per_node for slot in slots)
            return (
                EngineProcessPlan(node=node, node_rank=0, gpu_slots=slots, local_gpu_ids=local, rank=rank),
            )
        per_process = min(len(slots), gpus_per_node)
        chunks = [slots[offset : offset + per_process] for offset in range(0, len(slots), per_process)]
        return tuple(
            EngineProcessPlan(
                node=chunk[0] // gpus_per_node,
                node_rank=node_rank,
                gpu_slots=chunk,
                local_gpu_ids=tuple(slot % gpus_per_node for slot in chunk),
                rank=rank + node_rank,
            )
            for node_rank, chunk in enumerate(chunks)
        )


#: Why a plan has no engines at all.
NO_ENGINES_DEBUG_TRAIN_ONLY = "debug_train_only: no rollout engines are started"
NO_ENGINES_ZERO_ROLLOUT = (
    "rollout_num_gpus=0 and no sglang deployment: no rollout engines are started (as newer Miles: no models)"
)


def external_only(spec: DeploymentSpec) -> bool:
    """Whether every engine of ``spec`` runs elsewhere: external engines, and no group holding a GPU (Miles'
    ``--rollout-external``)."""
    has_external = any(model.external for model in spec.models)
    holds_gpus = any(
        is_int(group.num_gpus) and group.num_gpus > 0 for model in spec.models for group in model.groups
    )
    return has_external and not holds_gpus


def _external_layout(trainer: TrainerInputs, derivation: MilesDerivation) -> tuple[int, tuple[str, ...]]:
    """The rollout offset of a deployment of external engines only, and its note. Miles' placement for
    ``--rollout-external`` (``placement_group.py`` ``_get_placement_group_layout``): the actor's GPUs, then
    rollout, whether colocated or not (an actor of 1 x 2 GPUs: (2, 2)); with ``debug_rollout_only`` nothing
    (0, 0), Megatron holding no GPU."""
    offset = 0 if trainer.debug_rollout_only else trainer.actor_gpus
    if "rollout_num_gpus" not in derivation.derived:
        return offset, ()
    why = "debug_rollout_only" if trainer.debug_rollout_only else "colocate"
    return offset, (
        f"external engines only: the {trainer.rollout_num_gpus} GPUs that {why} gives rollout "
        f"(rollout_num_gpus) hold no engine here; Miles' placement for external engines: rollout_offset="
        f"{offset}, Megatron on {megatron_num_gpus(trainer)} GPUs",
    )


def _rollout_layout(
    spec: DeploymentSpec, trainer: TrainerInputs, derivation: MilesDerivation
) -> tuple[bool, int, tuple[str, ...]]:
    """Whether ``spec`` holds external engines only, its rollout offset (Miles' placement for
    ``--rollout-external`` then, else the trainer's) and what to note about it."""
    if not external_only(spec):
        return False, rollout_offset(trainer), ()
    offset, notes = _external_layout(trainer, derivation)
    return True, offset, notes


def _holds_engines(model: ModelSpec) -> bool:
    """Whether ``model`` has a server group or an external engine."""
    return bool(model.groups or model.external)


def _holds_no_engines(spec: DeploymentSpec) -> bool:
    """Whether no model of ``spec`` holds engines (an empty deployment too)."""
    return not any(_holds_engines(model) for model in spec.models)


def _without_models_of_no_engines(
    spec: DeploymentSpec, trainer: TrainerInputs
) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """With ``rollout_num_gpus=0`` and an eval fleet, the deployment less its models that hold no engine (the
    ``default`` preset's model, sized by that 0), and the note saying so: the eval fleet starts alone, as
    newer Miles does. Otherwise ``spec`` as it is (a model without engines is then refused)."""
    if trainer.rollout_num_gpus != 0 or trainer.eval_num_gpus == 0:
        return spec, ()
    empty = [str(m.name) for m in spec.models if m.name != "eval" and not _holds_engines(m)]
    if not empty:
        return spec, ()
    kept = tuple(m for m in spec.models if m.name not in empty)
    names = ", ".join(empty)
    note = (
        f"rollout_num_gpus=0: model(s) {names} hold no engines and do not start; the eval fleet starts alone"
    )
    return dataclasses.replace(spec, models=kept), (note,)


def _no_engines_in_spec(spec: DeploymentSpec) -> str:
    names = ", ".join(str(model.name) for model in spec.models) or "none"
    return (
        f"rollout_num_gpus=0 and the deployment holds no engines (models: {names}; no server group, no external "
        "engine): no rollout engines are started (as newer Miles: no models)"
    )


def _plan_without_engines(
    derivation: MilesDerivation, source: str, note: str = NO_ENGINES_DEBUG_TRAIN_ONLY
) -> DeploymentPlan:
    """The plan of ``debug_train_only`` without an eval fleet, or of ``rollout_num_gpus=0`` without a
    deployment: no engines (Miles resolves no models)."""
    trainer = derivation.trainer
    return DeploymentPlan(
        models=(),
        trainer=trainer,
        total_gpus=0,
        rollout_num_gpus=0,
        rollout_offset=rollout_offset(trainer),
        megatron_num_gpus=megatron_num_gpus(trainer),
        source=source,
        notes=(*derivation.notes, note),
        derived=derivation.derived,
    )


def eval_fleet_alone(spec: DeploymentSpec) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """What starts of ``spec`` under ``debug_train_only`` with an eval fleet: its model(s) named ``eval``; and
    the names of the others that hold engines (GPUs or external ones), which do not start (Miles' newer
    refactor: ``rollout_num_gpus`` is 0, so only the eval fleet starts; a model of no GPUs is no matter)."""
    kept = tuple(model for model in spec.models if model.name == "eval")
    left_out = tuple(
        str(model.name) for model in spec.models if model.name != "eval" and _holds_engines(model)
    )
    return dataclasses.replace(spec, models=kept), left_out


def _debug_train_only_spec(
    spec: DeploymentSpec, trainer: TrainerInputs, problems: ProblemCollector
) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """``spec`` as it starts (under ``debug_train_only``: the eval fleet alone), and the notes saying so. A
    deployment without an ``eval`` model is refused at once, with any problem found before."""
    if not trainer.debug_train_only:
        return spec, ()
    started, left_out = eval_fleet_alone(spec)
    notes = [
        f"debug_train_only: only the eval fleet starts (eval_num_gpus={trainer.eval_num_gpus}, from GPU slot "
        f"{rollout_offset(trainer)}); no rollout engines (rollout_num_gpus=0), as in Miles"
    ]
    if left_out:
        notes.append(
            f"debug_train_only: the deployment's model(s) {', '.join(left_out)} do not start, only its eval model "
            "(Miles' refactor refuses a --sglang-config then unless its eval model holds all of its GPUs)"
        )
    if not started.models:
        problems.add(
            "sglang",
            f"debug_train_only with eval_num_gpus={trainer.eval_num_gpus} starts only the eval fleet, but the "
            f"deployment has no model named 'eval' (models: {[m.name for m in spec.models]}); add one of "
            f"{trainer.eval_num_gpus} GPUs, or set eval_num_gpus=0 to start no engines",
        )
        problems.raise_if_any()
    return started, tuple(notes)


def _given_or_legacy_spec(
    spec: DeploymentSpec | None, trainer: TrainerInputs, problems: ProblemCollector
) -> DeploymentSpec:
    """``spec``, or Miles' legacy deployment when none is given (``prefill_num_servers`` is only for that)."""
    if spec is None:
        legacy = legacy_spec(trainer, problems)
        problems.raise_if_any()
        return legacy
    if trainer.prefill_num_servers is not None:
        problems.add(
            "prefill_num_servers",
            f"{trainer.prefill_num_servers} cannot be combined with an sglang deployment; describe prefill and "
            "decode groups in the deployment instead",
        )
    return spec


def without_unknown_override_keys(
    spec: DeploymentSpec, fields: Collection[str]
) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """``spec`` without the group override keys that are not ServerArgs fields of ``fields``, and one note per
    key left out. Miles does the same with a Miles file (it logs and drops what its SGLang lacks), so that an
    unmodified file, e.g. one setting ``prefill_round_robin_balance`` for SGLang 0.5.23, still plans."""
    known = frozenset(fields)
    notes: list[str] = []
    models = []
    for model in spec.models:
        groups = []
        for group in model.groups:
            kept = {}
            for name, value in group.overrides.items():
                if str(name).replace("-", "_") in known:
                    kept[name] = value
                else:
                    where = group.key or f"sglang.{model.name}.{group.name}"
                    notes.append(
                        f"left out {where}.overrides.{name}={thaw(value)!r}: not a ServerArgs field of this "
                        "SGLang version (Miles drops it too)"
                    )
            groups.append(dataclasses.replace(group, overrides=kept))
        models.append(dataclasses.replace(model, groups=tuple(groups)))
    return dataclasses.replace(spec, models=tuple(models)), tuple(notes)


def dashed_override_notes(spec: DeploymentSpec) -> tuple[str, ...]:
    """One note per group override key of a Miles file spelt with ``-`` (``pp-size``): read here as the
    ServerArgs field (``pp_size``), as slime does (``sglang_config.py`` normalises ``-`` to ``_``), where Miles
    (``sglang_engine.py`` ``_compute_server_args``) passes it on as written and drops it, no ServerArgs field
    having that name."""
    notes = []
    for model in spec.models:
        for group in model.groups:
            where = group.key or f"sglang.{model.name}.{group.name}"
            for name in group.overrides:
                if "-" in str(name):
                    norm = str(name).replace("-", "_")
                    notes.append(
                        f"read {where}.overrides.{name} as {norm}, as slime does; Miles drops a key spelt with "
                        f"'-' (no ServerArgs field has that name): write {norm} for both to read it"
                    )
    return tuple(notes)


def _miles_file_overrides(
    spec: DeploymentSpec, server_arg_fields: Collection[str] | None
) -> tuple[DeploymentSpec, tuple[str, ...]]:
    """A Miles file's group overrides as resolution reads them, with notes: dashed keys read as fields
    (:func:`dashed_override_notes`), and, given the installed SGLang's fields, the keys it lacks left out
    (:func:`without_unknown_override_keys`). Other specs are returned as they are."""
    if not spec.drops_unknown_override_keys:
        return spec, ()
    notes = dashed_override_notes(spec)
    if server_arg_fields is None:
        return spec, notes
    spec, left_out = without_unknown_override_keys(spec, server_arg_fields)
    return spec, notes + left_out


def _check_total(
    derivation: MilesDerivation,
    models: tuple[ModelPlan, ...],
    total: int,
    problems: ProblemCollector,
    external_only: bool = False,
) -> None:
    """A pinned ``rollout_num_gpus`` (plus eval) must equal the groups' total; eval cannot exceed it. Under
    ``debug_train_only`` only the eval fleet starts, which the eval check sizes. A deployment of external
    engines only is not held to the actor's GPUs that Miles' colocate (or debug_rollout_only) rule gives
    ``rollout_num_gpus``: its engines run elsewhere (Miles' ``--rollout-external``)."""
    trainer = derivation.trainer
    if trainer.debug_train_only:
        return
    if external_only and "rollout_num_gpus" in derivation.derived:
        return
    if trainer.rollout_num_gpus is not None and trainer.rollout_num_gpus + trainer.eval_num_gpus != total:
        breakdown = ", ".join(f"{model.name}={model.num_gpus}" for model in models)
        if "rollout_num_gpus" in derivation.derived:
            how = f"{trainer.actor_gpus} GPUs of the actor (colocate: Miles sets rollout_num_gpus to them)"
            fix = "size the groups to them"
        else:
            how = str(trainer.rollout_num_gpus)
            fix = "make them equal, or leave rollout_num_gpus unset to follow the groups"
        problems.add(
            "rollout_num_gpus",
            f"is {how}"
            + (f" (+ eval_num_gpus={trainer.eval_num_gpus})" if trainer.eval_num_gpus else "")
            + f" but the server groups hold {total} GPUs ({breakdown}); {fix}",
        )
    elif total - trainer.eval_num_gpus < 0:
        problems.add("eval_num_gpus", f"{trainer.eval_num_gpus} exceeds the {total} GPUs of the deployment")


#: The most GPUs a deployment may hold (65,536: 8,192 nodes of 8), whatever the cluster: resolution enumerates
#: every engine and GPU slot, so a count is bounded before that (a typo of 1e9 GPUs would never finish).
MAX_DEPLOYMENT_GPUS = 65_536


def _check_gpu_bounds(spec: DeploymentSpec, trainer: TrainerInputs, problems: ProblemCollector) -> bool:
    """Whether the spec's GPU counts fit the cluster (``num_nodes``, when given) and
    :data:`MAX_DEPLOYMENT_GPUS`; checked before any engine is enumerated."""
    counts = [
        (group.key or f"sglang.{model.name}.{group.name}", group.num_gpus)
        for model in spec.models
        for group in model.groups
        if is_int(group.num_gpus) and group.num_gpus > 0
    ]
    total = sum(count for _key, count in counts)
    if total > MAX_DEPLOYMENT_GPUS:
        largest_key, largest = max(counts, key=lambda item: item[1])
        problems.add(
            f"{largest_key}.num_gpus",
            f"{largest} GPUs: the deployment would hold {total:,} GPUs, more than the {MAX_DEPLOYMENT_GPUS:,} a "
            "deployment may hold",
        )
        return False
    before = len(problems.problems)
    _check_capacity(trainer, total, problems)
    return len(problems.problems) == before


def _check_capacity(trainer: TrainerInputs, total: int, problems: ProblemCollector) -> None:
    """The deployment fits the cluster of ``num_nodes`` (when given)."""
    if trainer.num_nodes is None:
        return
    capacity = trainer.num_nodes * trainer.num_gpus_per_node
    needed = max(rollout_offset(trainer) + total, megatron_num_gpus(trainer))
    if needed > capacity:
        problems.add(
            "num_nodes",
            f"the deployment needs {needed} GPU slots (rollout_offset={rollout_offset(trainer)} + {total} "
            f"rollout GPUs) but the cluster has num_nodes={trainer.num_nodes} x num_gpus_per_node="
            f"{trainer.num_gpus_per_node} = {capacity}",
        )


def resolve_deployment(
    spec: DeploymentSpec | None,
    trainer: TrainerInputs,
    *,
    server_arg_fields: Collection[str] | None = None,
    server_defaults: Mapping[str, Any] | None = None,
) -> DeploymentPlan:
    """Resolve a deployment into a frozen plan, or raise one error that lists every problem.

    The trainer's arguments first go through Miles' own post-processing (:func:`apply_miles_rules`: colocate
    defaults, the critic's size, ...); the plan holds the result and notes what was derived. ``spec=None``
    means no deployment was described: Miles' legacy behaviour (one regular group, or
    ``prefill_num_servers``, plus the eval fleet). ``server_arg_fields`` (the installed SGLang's ``ServerArgs``
    field names) turns on the check of override keys; without it override keys are not checked here (a spec
    read from a Miles file drops unknown ones instead, with a note, as Miles does). ``server_defaults``
    (``sglang_deploy.server_defaults``, Miles' ``--sglang-*`` values) take part in each engine's tp/pp/dp
    sizes, below every override. Under ``debug_train_only`` no rollout engine starts: with an eval fleet
    (``eval_num_gpus`` > 0) the eval model alone (of ``spec``, or the legacy one), after the actor's GPUs;
    without one, nothing."""
    source = spec.source if spec is not None else "trainer arguments"
    problems = ProblemCollector(source)
    problems.extend(trainer.problems())
    problems.raise_if_any()
    derivation = apply_miles_rules(trainer, server_defaults)
    trainer = derivation.trainer
    if not trainer.starts_inference_engines:
        return _plan_without_engines(derivation, source)
    if trainer.rollout_num_gpus == 0 and trainer.eval_num_gpus == 0:
        if spec is None:
            return _plan_without_engines(derivation, source, NO_ENGINES_ZERO_ROLLOUT)
        if _holds_no_engines(spec):
            return _plan_without_engines(derivation, source, _no_engines_in_spec(spec))

    spec = _given_or_legacy_spec(spec, trainer, problems)
    spec, started = _debug_train_only_spec(spec, trainer, problems)
    spec, emptied = _without_models_of_no_engines(spec, trainer)
    if not _check_gpu_bounds(spec, trainer, problems):  # before any engine is enumerated
        problems.raise_if_any()
    spec, dropped = _miles_file_overrides(spec, server_arg_fields)
    outside, offset, layout_notes = _rollout_layout(spec, trainer, derivation)
    resolver = _Resolver(spec, trainer, problems, server_arg_fields, server_defaults)
    resolver.rollout_offset = offset
    models = resolver.run()
    total = resolver.cursor
    _check_total(derivation, models, total, problems, outside)
    _check_capacity(trainer, total, problems)
    problems.raise_if_any()
    advice = advisory_notes(models, trainer, resolver.rollout_offset)  # placeholder paths, idle offload
    return DeploymentPlan(
        models=models,
        trainer=trainer,
        total_gpus=total,
        rollout_num_gpus=total - trainer.eval_num_gpus,
        rollout_offset=resolver.rollout_offset,
        megatron_num_gpus=megatron_num_gpus(trainer),
        source=spec.source,
        notes=(*derivation.notes, *started, *emptied, *dropped, *layout_notes, *advice),
        derived=derivation.derived,
        derived_server_defaults=derivation.server_defaults,
    )
