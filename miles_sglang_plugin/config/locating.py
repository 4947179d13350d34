"""Where the ``sglang`` group and the trainer's inputs are in a composed config.

The group may sit at the root key ``sglang`` (``- sglang: pd`` in the defaults list) or under any other package
(``- sglang@actor_rollout_ref.rollout.engines: pd``). Its key is taken from the caller, else from Hydra's
record of the choices it made (``hydra.runtime.choices``: ``sglang@<package>``), else it is ``sglang`` if the
config has that key, else the node that holds typed models (``ModelConf``), else ``sglang``.

The trainer's inputs (Miles' argument names: ``hf_checkpoint``, ``rollout_num_gpus_per_engine``, ...) are
looked up from the group outwards: next to the group's node, then in each enclosing node up to the root; the
first node that holds the name wins. For the root placement that is the root. The schema's defaults use the
same lookup (the ``msp.trainer`` resolver), so ``--cfg job --resolve`` shows what resolution reads.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping
from typing import Any

from omegaconf import Container, DictConfig, OmegaConf

#: The group's node when nothing says otherwise.
DEFAULT_SGLANG_KEY = "sglang"
#: ``${msp.trainer:NAME,DEFAULT}``: the trainer's input NAME as found from the group outwards (DEFAULT when no
#: enclosing node holds it, or it is null).
TRAINER_RESOLVER = "msp.trainer"
#: ``${msp.rollout_num_gpus:DEFAULT}``: the trainer's rollout_num_gpus after Miles' post-processing of its
#: arguments (colocated: the actor's GPUs; debug_train_only: 0), DEFAULT when that leaves it unset (the ``default`` preset's size).
ROLLOUT_GPUS_RESOLVER = "msp.rollout_num_gpus"


def _parent(node: Container) -> Container | None:
    # OmegaConf keeps no public accessor for a node's parent; a container's parent is a container.
    return node._get_parent_container()


def _ancestors(node: Container | None) -> Iterator[Container]:
    while node is not None:
        yield node
        node = _parent(node)


def _is_model_node(node: Container) -> bool:
    from miles_sglang_plugin.config.schema import ModelConf

    object_type = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
    return isinstance(object_type, type) and issubclass(object_type, ModelConf)


def enclosing_nodes(group_node: Container | None) -> Iterator[Container]:
    """The nodes around the group's node (its parent first, the root last), where trainer inputs are found."""
    yield from _ancestors(_parent(group_node) if group_node is not None else None)


def find_trainer_value(nodes: Iterator[Container], name: str) -> tuple[bool, Any]:
    """(found, value) of ``name`` in the first of ``nodes`` that holds it (interpolations resolved in place)."""
    for node in nodes:
        if isinstance(node, DictConfig) and name in node:
            return True, node[name]
    return False, None


def trainer_value(nodes: list[Container], name: str) -> tuple[bool, Any]:
    """(found, value) of the trainer's input ``name``: from ``nodes`` (the group outwards) where one holds it
    and it is not null, else from the trainer's own keys where the config names a trainer mapping
    (``sglang_trainer=verl``: :mod:`~miles_sglang_plugin.config.trainer_mappings`)."""
    found, value = find_trainer_value(iter(nodes), name)
    if found and value is not None:
        return found, value
    from miles_sglang_plugin.config.trainer_mappings import trainer_mapping

    mapping = trainer_mapping(nodes[-1]) if nodes else None
    if mapping is not None and name in mapping.values:
        return True, mapping.values[name]
    return found, value


def _group_node_of(node: Container) -> Container | None:
    """The group's node around ``node`` (a model's or a group's field): the parent of its model (None: a model
    node at the root)."""
    model = next((ancestor for ancestor in _ancestors(node) if _is_model_node(ancestor)), None)
    return _parent(model) if model is not None else node


def _trainer_resolver(name: str, default: Any = None, *, _parent_: Container) -> Any:
    """``${msp.trainer:NAME,DEFAULT}`` written anywhere inside a model of the group (a model's or a group's
    field): NAME from the group outwards, DEFAULT when absent or null."""
    found, value = trainer_value(list(enclosing_nodes(_group_node_of(_parent_))), name)
    return default if not found or value is None else value


#: The trainer's inputs Miles' post-processing reads to size the rollout (``TrainerInputs.miles_rollout_num_gpus``).
_ROLLOUT_SIZE_INPUTS = (
    "rollout_num_gpus",
    "colocate",
    "debug_rollout_only",
    "debug_train_only",
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "offload_rollout",
)


def _rollout_gpus_resolver(default: Any = None, *, _parent_: Container) -> Any:
    """``${msp.rollout_num_gpus:DEFAULT}``: rollout_num_gpus as resolution will read it, after Miles' own
    post-processing (:attr:`~miles_sglang_plugin.config.trainer_inputs.TrainerInputs.miles_rollout_num_gpus`:
    colocated, the actor's GPUs); DEFAULT when unset. Inputs that do not read are left to resolution to report."""
    from miles_sglang_plugin.config.trainer_inputs import TrainerInputs

    nodes = list(enclosing_nodes(_group_node_of(_parent_)))
    values = {}
    for name in _ROLLOUT_SIZE_INPUTS:
        found, value = trainer_value(nodes, name)
        if found:
            values[name] = value
    try:
        derived = TrainerInputs.from_mapping(values).miles_rollout_num_gpus
    except (TypeError, ValueError):
        derived = values.get("rollout_num_gpus")
    return default if derived is None else derived


def register_resolvers() -> None:
    """Register ``msp.trainer`` and ``msp.rollout_num_gpus`` once (OmegaConf 2.3's ``register_new_resolver``;
    2.4's ``register_resolver``, whose older spelling warns, which Hydra's plugin scan would re-print in every
    app)."""
    register = OmegaConf.register_resolver
    modern = "replace" in inspect.signature(register).parameters  # OmegaConf >= 2.4
    for name, resolver in (
        (TRAINER_RESOLVER, _trainer_resolver),
        (ROLLOUT_GPUS_RESOLVER, _rollout_gpus_resolver),
    ):
        if OmegaConf.has_resolver(name):
            continue
        if modern:
            register(name, resolver, use_cache=False)  # type: ignore[call-arg]  # OmegaConf 2.4's signature
        else:
            OmegaConf.register_new_resolver(name, resolver, use_cache=False)


def keys_from_choices(choices: Mapping[str, Any]) -> list[str]:
    """The keys the ``sglang`` group was placed at, from Hydra's ``runtime.choices`` (``sglang@<package>``)."""
    keys = []
    for choice_key in choices:
        group, _, package = str(choice_key).partition("@")
        if group == DEFAULT_SGLANG_KEY:
            keys.append(package.removeprefix("_global_.") or DEFAULT_SGLANG_KEY)
    return keys


def hydra_choices(cfg: DictConfig) -> Mapping[str, Any]:
    """Hydra's record of the group choices: the ``hydra`` node of ``cfg`` (a config composed with
    ``return_hydra_config=True``, or a callback's), else the running job's; empty when neither is there."""
    from hydra.core.hydra_config import HydraConfig

    node = OmegaConf.select(cfg, "hydra.runtime.choices", default=None)
    if isinstance(node, DictConfig):
        return node
    if HydraConfig.initialized():
        return HydraConfig.get().runtime.choices
    return {}


#: How deep :func:`nodes_holding_models` looks for the group's node.
MAX_SEARCH_DEPTH = 8


def nodes_holding_models(node: DictConfig, key: str = "", depth: int = 0) -> list[str]:
    """Keys of the nodes that hold typed models (the group's node, wherever it is), without resolving
    anything; ``hydra`` is skipped."""
    found: list[str] = []
    children = [(k, node._get_node(k)) for k in node if not (depth == 0 and k == "hydra")]
    if any(isinstance(child, DictConfig) and _is_model_node(child) for _, child in children):
        found.append(key or DEFAULT_SGLANG_KEY)
    elif depth < MAX_SEARCH_DEPTH:
        for child_key, child in children:
            if isinstance(child, DictConfig) and not child._is_none() and not child._is_interpolation():
                found += nodes_holding_models(
                    child, f"{key}.{child_key!s}" if key else str(child_key), depth + 1
                )
    return found


def sglang_keys(cfg: DictConfig, sglang_key: str | None) -> list[str]:
    """Where the group is: the key given; else where Hydra placed it (possibly several keys); else ``sglang``
    when the config has that key; else the nodes holding typed models; else ``sglang``."""
    if sglang_key is not None:
        return [sglang_key]
    placed = keys_from_choices(hydra_choices(cfg))
    if placed:
        return placed
    if OmegaConf.select(cfg, DEFAULT_SGLANG_KEY, default=None, throw_on_resolution_failure=False) is not None:
        return [DEFAULT_SGLANG_KEY]
    return nodes_holding_models(cfg) or [DEFAULT_SGLANG_KEY]
