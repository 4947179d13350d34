"""The trainers' own keys as the plugin's trainer inputs: ``sglang_trainer=verl`` and ``sglang_trainer=skyrl``.

A trainer with its own config tree (verl's ``ppo_trainer``, SkyRL's ``ppo_base_config``, both unchanged) adds
``+sglang_trainer=verl`` (or ``skyrl``); resolution then reads its keys under Miles' names wherever the tree
does not name them itself (a Miles name found from the group outwards still wins). Every problem names the
key the user typed (``actor_rollout_ref.rollout.tensor_model_parallel_size``), never the internal name.

What each mapping gives:

- the trainer inputs (:class:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs`): checkpoint, GPUs
  per engine (TP x DP x PP, the GPUs the trainer gives one engine), nodes, GPUs per node, colocation, rollout
  GPUs from the trainer's engine counts, seed;
- sizes of a PD deployment's groups (``prefill_num_gpus``, ``decode_num_gpus``, ``decode_num_gpus_per_engine``),
  which the ``pd`` preset reads (verl's ``disaggregation``);
- deployment-wide ServerArgs values, below ``sglang_deploy.server_defaults``: ``mem_fraction_static`` from the
  trainer's GPU memory share, ``pp_size`` / ``dp_size`` / ``ep_size`` / ``enable_dp_attention``;
- checks of what only the trainer's keys say: the engine is SGLang (``vllm`` is refused, naming the key), DP
  needs DP attention (Miles refuses ``--sglang-dp-size`` > 1 without it; verl and SkyRL size a DP engine as
  TP x DP GPUs, which is SGLang's DP attention), a colocated SkyRL deployment is as large as its policy.

The mapping is computed from the composed config wherever it is needed (resolution, the ``msp.trainer``
resolver), so the config itself holds nothing but the trainer's own keys and ``sglang_trainer.trainer``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from omegaconf import Container, DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from miles_sglang_plugin.errors import Problem, first_line

#: The root key of the mapping's node (``+sglang_trainer=verl`` puts ``sglang_trainer: {trainer: verl}`` there).
TRAINER_MAPPING_KEY = "sglang_trainer"
#: Inputs a mapping may give that are not Miles' arguments: the sizes of a PD deployment's groups, read by
#: the ``pd`` preset.
GROUP_SIZE_INPUTS = ("prefill_num_gpus", "decode_num_gpus", "decode_num_gpus_per_engine")


class TrainerKind(StrEnum):
    """The trainers whose keys the plugin maps."""

    verl = "verl"
    skyrl = "skyrl"


@dataclass(frozen=True)
class TrainerMapping:
    """What a trainer's keys say, under the plugin's names."""

    trainer: str
    #: Input name (Miles' argument, or one of :data:`GROUP_SIZE_INPUTS`) -> value.
    values: Mapping[str, Any]
    #: Input name -> the trainer's keys it came from, as typed (``trainer.nnodes=2``).
    sources: Mapping[str, str]
    #: ServerArgs field -> value (below ``sglang_deploy.server_defaults``).
    server_defaults: Mapping[str, Any]
    #: ServerArgs field -> the trainer's key it came from.
    server_sources: Mapping[str, str]
    problems: tuple[Problem, ...]
    #: The trainer's key that turns PD on, when it does (verl's ``disaggregation.enabled``).
    pd_key: str | None = None


_ABSENT = object()


class _Keys:
    """Reads the trainer's keys from the root of the composed config; every problem names the key."""

    def __init__(self, root: DictConfig) -> None:
        self.root = root
        self.problems: list[Problem] = []
        self.values: dict[str, Any] = {}
        self.sources: dict[str, str] = {}
        self.server_defaults: dict[str, Any] = {}
        self.server_sources: dict[str, str] = {}

    def raw(self, key: str, default: Any = _ABSENT) -> Any:
        """The value at ``key`` (interpolations resolved), ``default`` when absent; None (reported) when it does
        not read and there is no default."""
        try:
            value = OmegaConf.select(self.root, key, default=_ABSENT, throw_on_missing=True)
        except MissingMandatoryValue:
            self.problems.append(Problem(key, "is unset (???)"))
            return None
        except OmegaConfBaseException as exc:
            self.problems.append(Problem(key, first_line(exc)))
            return None
        if value is _ABSENT:
            if default is _ABSENT:
                self.problems.append(Problem(key, "is not in the config (the trainer's own key)"))
                return None
            return default
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value

    def integer(self, key: str, minimum: int = 1, default: Any = _ABSENT) -> int | None:
        value = self.raw(key, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.problems.append(Problem(key, f"must be an integer >= {minimum}, got {value!r}"))
            return None
        return value

    def flag(self, key: str, default: Any = _ABSENT) -> bool | None:
        value = self.raw(key, default)
        if value is not None and not isinstance(value, bool):
            self.problems.append(Problem(key, f"must be true or false, got {value!r}"))
            return None
        return value

    def fraction(self, key: str) -> float | None:
        value = self.raw(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
            self.problems.append(Problem(key, f"must be a fraction of GPU memory in (0, 1], got {value!r}"))
            return None
        return value

    def text(self, key: str) -> str | None:
        value = self.raw(key)
        if value is not None and not isinstance(value, str):
            self.problems.append(Problem(key, f"must be a string, got {value!r}"))
            return None
        return value

    def give(self, name: str, value: Any, *sources: tuple[str, Any]) -> None:
        """Input ``name`` = ``value``, from the trainer's keys ``sources`` (key, value); skipped when a source
        did not read (reported already)."""
        if value is None or any(v is None for _, v in sources):
            return
        self.values[name] = value
        self.sources[name] = " x ".join(f"{key}={_shown(v)}" for key, v in sources)

    def server_default(self, name: str, value: Any, source: str) -> None:
        self.server_defaults[name] = value
        self.server_sources[name] = source

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


# ---------------------------------------------------------------------------------------- shared rules
def _engine_name(keys: _Keys, key: str, trainer: str) -> None:
    """The trainer's engine switch must say SGLang: the group starts SGLang engines, never another engine."""
    try:
        name = OmegaConf.select(keys.root, key, default=None, throw_on_missing=True)
    except MissingMandatoryValue:
        name = None
    except OmegaConfBaseException as exc:
        keys.problem(key, first_line(exc))
        return
    if name is None:
        keys.problem(key, f"is unset; set {key}=sglang (the sglang group serves SGLang engines)")
    elif str(name) != "sglang":
        keys.problem(
            key,
            f"is {name!r}, but the sglang group serves SGLang engines: set {key}=sglang, or leave "
            f"sglang_trainer={trainer} (and the sglang group) out to let {trainer} run {name}",
        )


def _engine_parallel(keys: _Keys, prefix: str, names: Mapping[str, str], dp_attention_key: str) -> int | None:
    """TP, PP, DP and EP of one engine from the trainer's keys ``prefix + names[...]``; returns its GPUs
    (TP x DP x PP, as the trainer counts them) and gives the matching ServerArgs defaults: ``--tp-size`` is
    TP x DP (each DP rank an attention replica inside the engine: SGLang's DP attention), ``--dp-size`` DP,
    ``--pp-size`` PP, ``--ep-size`` EP."""
    tp, dp, pp, ep = (keys.integer(prefix + names[n]) for n in ("tp", "dp", "pp", "ep"))
    if None in (tp, dp, pp, ep):
        return None
    assert tp is not None and dp is not None and pp is not None and ep is not None
    if pp > 1:
        keys.server_default("pp_size", pp, prefix + names["pp"])
    if dp > 1:
        if _dp_attention(keys, dp_attention_key):
            keys.server_default("dp_size", dp, prefix + names["dp"])
            keys.server_default("enable_dp_attention", True, dp_attention_key)
        else:
            keys.problem(
                prefix + names["dp"],
                f"{dp} needs SGLang's DP attention: the trainer gives one engine {names['tp']}={tp} x "
                f"{names['dp']}={dp} = {tp * dp} GPUs (--tp-size {tp * dp} --dp-size {dp}), which SGLang runs as {dp} attention "
                f"replicas only with DP attention (without it, --dp-size {dp} would need {tp * dp * dp} GPUs); "
                f"set {dp_attention_key}=true (Miles refuses --sglang-dp-size > 1 without "
                "--sglang-enable-dp-attention too)",
            )
    if ep > 1:
        if (tp * dp) % ep:
            keys.problem(
                prefix + names["ep"],
                f"{ep} must divide the engine's TP ({names['tp']}={tp} x {names['dp']}={dp} = {tp * dp}): SGLang splits "
                "the experts of its TP ranks",
            )
        else:
            keys.server_default("ep_size", ep, prefix + names["ep"])
    return tp * dp * pp


def _dp_attention(keys: _Keys, engine_kwargs_key: str) -> bool:
    """DP attention turned on in the trainer's own engine arguments (or the deployment-wide defaults)."""
    given = keys.raw(engine_kwargs_key, None)
    deploy = keys.raw("sglang_deploy.server_defaults.enable_dp_attention", None)
    return given is True or deploy is True


def _memory_fraction(keys: _Keys, key: str) -> None:
    fraction = keys.fraction(key)
    if fraction is not None:
        keys.server_default("mem_fraction_static", fraction, key)


# -------------------------------------------------------------------------------------------------- verl
_VERL_ROLLOUT = "actor_rollout_ref.rollout."
_VERL_PARALLEL = {
    "tp": "tensor_model_parallel_size",
    "dp": "data_parallel_size",
    "pp": "pipeline_model_parallel_size",
    "ep": "expert_parallel_size",
}


def _verl(keys: _Keys) -> str | None:
    """verl 0.9.1's ``ppo_trainer`` keys. Hybrid engine (the default): rollout on every training GPU, colocated;
    ``hybrid_engine=false``: a standalone rollout pool of ``rollout.nnodes`` x ``rollout.n_gpus_per_node``
    after the trainer's nodes. Returns the PD key when verl's disaggregation is on."""
    r = _VERL_ROLLOUT
    _engine_name(keys, r + "name", "verl")
    path = keys.text("actor_rollout_ref.model.path")
    keys.give("hf_checkpoint", path, ("actor_rollout_ref.model.path", path))
    per_engine = _engine_parallel(keys, r, _VERL_PARALLEL, r + "engine_kwargs.sglang.enable_dp_attention")
    keys.give("rollout_num_gpus_per_engine", per_engine, *_parallel_sources(keys, r, _VERL_PARALLEL))
    _memory_fraction(keys, r + "gpu_memory_utilization")
    seed = keys.integer(r + "seed", minimum=0)
    keys.give("seed", seed, (r + "seed", seed))
    nnodes, per_node = keys.integer("trainer.nnodes"), keys.integer("trainer.n_gpus_per_node")
    hybrid = keys.flag("actor_rollout_ref.hybrid_engine", True)
    keys.give("num_gpus_per_node", per_node, ("trainer.n_gpus_per_node", per_node))
    keys.give("actor_num_nodes", nnodes, ("trainer.nnodes", nnodes))
    keys.give("actor_num_gpus_per_node", per_node, ("trainer.n_gpus_per_node", per_node))
    keys.give("colocate", hybrid, ("actor_rollout_ref.hybrid_engine", hybrid))
    rollout_gpus = _verl_rollout_pool(keys, hybrid, nnodes, per_node)
    if keys.flag(r + "disaggregation.enabled", False):
        _verl_pd(keys, per_engine, rollout_gpus)
        return r + "disaggregation.enabled"
    return None


def _parallel_sources(keys: _Keys, prefix: str, names: Mapping[str, str]) -> list[tuple[str, Any]]:
    """The parallel keys behind an engine's GPUs as typed; those left at 1 only when all are."""
    given = [(prefix + names[n], keys.raw(prefix + names[n], None)) for n in ("tp", "dp", "pp")]
    shown = [(k, v) for k, v in given if v != 1] or given[:1]
    return shown


def _verl_rollout_pool(
    keys: _Keys, hybrid: bool | None, nnodes: int | None, per_node: int | None
) -> int | None:
    """The rollout GPUs: every training GPU (hybrid engine), else the standalone pool after the trainer's
    nodes (the cluster then has ``trainer.nnodes + rollout.nnodes`` nodes)."""
    r = _VERL_ROLLOUT
    if hybrid is None or nnodes is None or per_node is None:
        return None
    if hybrid:
        keys.give("num_nodes", nnodes, ("trainer.nnodes", nnodes))
        return nnodes * per_node
    pool_nodes = keys.integer(r + "nnodes", minimum=0)
    pool_per_node = keys.integer(r + "n_gpus_per_node")
    if pool_nodes == 0:
        keys.problem(
            r + "nnodes",
            "is 0, but with actor_rollout_ref.hybrid_engine=false rollout runs on a standalone pool of its own "
            "nodes (verl: rollout.nnodes must be > 0); set it",
        )
        return None
    if pool_nodes is None or pool_per_node is None:
        return None
    if pool_per_node != per_node:
        keys.problem(
            r + "n_gpus_per_node",
            f"{pool_per_node} differs from trainer.n_gpus_per_node={per_node}; the deployment's nodes all have "
            "one GPU count (num_gpus_per_node)",
        )
        return None
    keys.give(
        "rollout_num_gpus",
        pool_nodes * per_node,
        (r + "nnodes", pool_nodes),
        (r + "n_gpus_per_node", per_node),
    )
    keys.give("num_nodes", nnodes + pool_nodes, ("trainer.nnodes", nnodes), (r + "nnodes", pool_nodes))
    return pool_nodes * per_node


def _verl_pd(keys: _Keys, per_engine: int | None, rollout_gpus: int | None) -> None:
    """verl's PD unit (``disaggregation``): ``prefill_replicas`` prefill engines of TP x PP GPUs and
    ``decode_replicas`` decode engines of the decode TP (default: TP) x PP, repeated over the rollout GPUs."""
    d = _VERL_ROLLOUT + "disaggregation."
    prefill, decode = keys.integer(d + "prefill_replicas"), keys.integer(d + "decode_replicas")
    decode_tp = keys.raw(d + "decode_tensor_model_parallel_size", None)
    if decode_tp is not None:
        decode_tp = keys.integer(d + "decode_tensor_model_parallel_size")
    pp = keys.raw(_VERL_ROLLOUT + "pipeline_model_parallel_size", 1)
    if None in (prefill, decode, per_engine, rollout_gpus) or not isinstance(pp, int):
        return
    assert prefill is not None and decode is not None and per_engine is not None and rollout_gpus is not None
    decode_per_engine = decode_tp * pp if isinstance(decode_tp, int) else per_engine
    unit = prefill * per_engine + decode * decode_per_engine
    if rollout_gpus % unit:
        keys.problem(
            d + "decode_replicas",
            f"a PD unit of {d}prefill_replicas={prefill} x {per_engine} GPUs + decode_replicas={decode} x "
            f"{decode_per_engine} GPUs = {unit} GPUs does not divide the {rollout_gpus} rollout GPUs",
        )
        return
    units = rollout_gpus // unit
    keys.give("prefill_num_gpus", units * prefill * per_engine, (d + "prefill_replicas", prefill))
    keys.give("decode_num_gpus", units * decode * decode_per_engine, (d + "decode_replicas", decode))
    if decode_tp is not None:  # else the decode engines inherit the model's GPUs per engine, as any group
        key = d + "decode_tensor_model_parallel_size"
        keys.give("decode_num_gpus_per_engine", decode_per_engine, (key, decode_tp))


# ------------------------------------------------------------------------------------------------- SkyRL
_SKYRL_PARALLEL = {
    "tp": "inference_engine_tensor_parallel_size",
    "dp": "inference_engine_data_parallel_size",
    "pp": "inference_engine_pipeline_parallel_size",
    "ep": "inference_engine_expert_parallel_size",
}


def _skyrl(keys: _Keys) -> None:
    """skyrl-train 0.3.1's ``ppo_base_config`` keys: ``generator.num_inference_engines`` engines of TP x PP x DP
    GPUs each (SkyRL's count), remote (``run_engines_locally=false``: SkyRL then talks to them through
    ``generator.remote_inference_engine_urls``); colocated with the policy under ``colocate_all``."""
    g, p = "generator.", "trainer.placement."
    _engine_name(keys, g + "backend", "skyrl")
    if keys.flag(g + "run_engines_locally", True):
        keys.problem(
            g + "run_engines_locally",
            "is true, so SkyRL would start engines of its own beside these; set it to false: SkyRL then uses "
            "this deployment's engines (generator.remote_inference_engine_urls, filled from the running "
            "deployment by miles_sglang_plugin.app.trainers.fill_skyrl_engine_urls)",
        )
    path = keys.text("trainer.policy.model.path")
    keys.give("hf_checkpoint", path, ("trainer.policy.model.path", path))
    per_engine = _engine_parallel(keys, g, _SKYRL_PARALLEL, g + "engine_init_kwargs.enable_dp_attention")
    keys.give("rollout_num_gpus_per_engine", per_engine, *_parallel_sources(keys, g, _SKYRL_PARALLEL))
    _memory_fraction(keys, g + "gpu_memory_utilization")
    seed = keys.integer("trainer.seed", minimum=0)
    keys.give("seed", seed, ("trainer.seed", seed))
    nodes, per_node = keys.integer(p + "policy_num_nodes"), keys.integer(p + "policy_num_gpus_per_node")
    colocate = keys.flag(p + "colocate_all")
    keys.give("actor_num_nodes", nodes, (p + "policy_num_nodes", nodes))
    keys.give("actor_num_gpus_per_node", per_node, (p + "policy_num_gpus_per_node", per_node))
    keys.give("num_gpus_per_node", per_node, (p + "policy_num_gpus_per_node", per_node))
    keys.give("colocate", colocate, (p + "colocate_all", colocate))
    engines = keys.integer(g + "num_inference_engines")
    if None in (engines, per_engine):
        return
    assert engines is not None and per_engine is not None
    keys.give("rollout_num_gpus", engines * per_engine, (g + "num_inference_engines", engines))
    if colocate and nodes is not None and per_node is not None and engines * per_engine != nodes * per_node:
        _skyrl_colocated_size(keys, engines, per_engine, nodes, per_node)


def _skyrl_colocated_size(keys: _Keys, engines: int, per_engine: int, nodes: int, per_node: int) -> None:
    """Colocated, SkyRL's engines fill its policy's GPUs exactly: the refusal names the engine count and the
    parallel keys that size one engine, as typed, and the count that would fit (if one does)."""
    g, p = "generator.", "trainer.placement."
    parallel = " x ".join(f"{k}={v}" for k, v in _parallel_sources(keys, g, _SKYRL_PARALLEL))
    policy = nodes * per_node
    if policy % per_engine == 0:
        fix = f"set {g}num_inference_engines={policy // per_engine}"
    else:
        fix = (
            f"no engine count fills {_gpus(policy)} with {_gpus(per_engine)} per engine: make the engine's GPUs "
            f"({parallel}) divide {policy}"
        )
    keys.problem(
        g + "num_inference_engines",
        f"{engines} engine(s) x {_gpus(per_engine)} each ({parallel}) = {_gpus(engines * per_engine)}, but colocated "
        f"({p}colocate_all=true) rollout runs on the policy's {_gpus(policy)} ({p}policy_num_nodes={nodes} x "
        f"policy_num_gpus_per_node={per_node}), as SkyRL requires: {fix}",
    )


def _gpus(count: int) -> str:
    return f"{count} GPU" if count == 1 else f"{count} GPUs"


_MAPPINGS: dict[str, Callable[[_Keys], str | None]] = {"verl": _verl, "skyrl": _skyrl}


def _root(node: Container) -> Container:
    # OmegaConf keeps no public accessor for a node's parent; a container's parent is a container.
    while (parent := node._get_parent_container()) is not None:
        node = parent
    return node


def trainer_mapping(cfg: Container) -> TrainerMapping | None:
    """The mapping of the trainer named at the root's ``sglang_trainer.trainer`` (``cfg`` may be any node of the
    composed config); None when the config has none."""
    root = _root(cfg)
    if not isinstance(root, DictConfig):
        return None
    try:
        node = root.get(TRAINER_MAPPING_KEY)
        name = node.get("trainer") if isinstance(node, DictConfig) else None
    except OmegaConfBaseException as exc:
        return _failed(str(TRAINER_MAPPING_KEY), first_line(exc))
    if node is None:
        return None
    if str(name) not in _MAPPINGS:
        return _failed(
            f"{TRAINER_MAPPING_KEY}.trainer", f"{name!r} is not a trainer; valid: {', '.join(_MAPPINGS)}"
        )
    keys = _Keys(root)
    pd_key = _MAPPINGS[str(name)](keys)
    return TrainerMapping(
        trainer=str(name),
        values=MappingProxyType(keys.values),
        sources=MappingProxyType(keys.sources),
        server_defaults=MappingProxyType(keys.server_defaults),
        server_sources=MappingProxyType(keys.server_sources),
        problems=tuple(dict.fromkeys(keys.problems)),  # a key read twice is reported once
        pd_key=pd_key,
    )


def _failed(key: str, message: str) -> TrainerMapping:
    empty: Mapping[str, Any] = MappingProxyType({})
    return TrainerMapping(
        "", empty, MappingProxyType({}), empty, MappingProxyType({}), (Problem(key, message),)
    )


def name_the_trainer_keys(problems: list[Problem], mapping: TrainerMapping | None) -> list[Problem]:
    """Problems with the trainer's keys in place of the inputs they were mapped to: a problem of
    ``rollout_num_gpus_per_engine`` becomes one of ``actor_rollout_ref.rollout.tensor_model_parallel_size=3``;
    a message that speaks of mapped values (``num_gpus_per_engine=3``, ``num_nodes=4``) says which of the
    trainer's keys they are."""
    if mapping is None or not mapping.trainer:
        return problems
    out = []
    for problem in problems:
        mentioned = [
            f"{name} is {source}"
            for name, source in mapping.sources.items()
            if name != problem.key and _mentions(problem, name)
        ]
        legend = f"; {'; '.join(mentioned)}" if mentioned else ""
        if problem.key in mapping.sources:
            message = f"{problem.message} (as {problem.key}{legend}: sglang_trainer={mapping.trainer})"
            out.append(Problem(mapping.sources[problem.key], message))
        elif mentioned:
            out.append(
                Problem(problem.key, f"{problem.message} ({legend[2:]}: sglang_trainer={mapping.trainer})")
            )
        else:
            out.append(problem)
    return out


#: How a message may speak of a mapped input besides its own name (a group's GPUs per engine, inherited).
_ALSO_SPOKEN_AS = {"rollout_num_gpus_per_engine": "num_gpus_per_engine"}


def _mentions(problem: Problem, name: str) -> bool:
    """Whether the problem speaks of input ``name`` as a word of its own (not a part of a dotted key)."""
    text = f"{problem.key} {problem.message}"
    words = [name] + ([_ALSO_SPOKEN_AS[name]] if name in _ALSO_SPOKEN_AS else [])
    return any(re.search(rf"(?<![\w.]){re.escape(word)}\b", text) for word in words)
