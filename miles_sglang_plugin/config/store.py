"""Registration of the schemas in Hydra's ConfigStore (called by the plugin module at Hydra start-up).

Config groups registered here (the ``sglang`` presets themselves are YAML files under ``conf/sglang``):

- ``sglang_model``: ``base`` — the typed schema of one model. Presets type their models with it
  (``- /sglang_model@actor: base``), and a model is added from the command line with
  ``+sglang_model@sglang.<name>=base``.
- ``sglang_group``: ``regular``, ``prefill``, ``decode``, ``placeholder`` — a further group of a model, beside
  its four fixed slots: ``+sglang_group@sglang.<model>.extra_groups.<name>=decode``.
- ``sglang_deploy``: ``default`` (real SGLang engines), ``simulated`` (the HTTP stand-in engines) and
  ``cpu_sglang`` (real SGLang on a machine without a GPU) — deployment-wide launcher, router and SGLang
  settings at the root key ``sglang_deploy``.
- ``hydra/callbacks``: ``sglang_cleanup`` — stops any deployment a job left running when the job ends;
  ``sglang_plan`` — the app's dry run: prints the plan of the app's own config and runs nothing.
- ``miles_trainer_args``: Miles' trainer arguments as a root schema, for apps that want them typed.
- ``sglang_trainer``: ``verl``, ``skyrl`` — a trainer's own keys read as the trainer inputs
  (:mod:`miles_sglang_plugin.config.trainer_mappings`), at the root key ``sglang_trainer``.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Callable
from typing import Any

from hydra.core.config_store import ConfigNode, ConfigStore

from miles_sglang_plugin.config.locating import register_resolvers

PROVIDER = "miles_sglang_plugin"


class LazyNode:
    """A ConfigStore node made on first use. Hydra's plugin scan registers the package's schemas in every Hydra
    app, whether it uses them or not; building a structured config of a large schema (``OmegaConf.structured``)
    is the costly part, so the node stored is this one, which builds it when Hydra first loads it
    (``ConfigStore.load`` hands out a deep copy of the stored node: that copy is made here) and keeps it, as
    a pickle: Hydra loads each node two or three times a compose, and unpickling a structured config is about
    six times faster than deep-copying it (0.5 ms against 2.9 ms for ``SGLangDeployConf``), with the same
    result. ``make`` returns the dataclass (or instance) the node is made of; a module-level function, so that
    Hydra's launchers that pickle the ConfigStore can. ``name`` names the node in the disk cache, which keeps
    the pickle for the next process (:mod:`miles_sglang_plugin.config.node_cache`)."""

    def __init__(self, make: Callable[[], Any], name: str) -> None:
        self.make = make
        self.name = name
        self._pickled: bytes | None = None

    def node(self) -> Any:
        """A new copy of the structured config (built once per process, or loaded from the disk cache)."""
        if self._pickled is None:
            from miles_sglang_plugin.config import node_cache

            made = self.make()
            cached = node_cache.load(self.name, made)
            if cached is not None:
                self._pickled, node = cached
                return node
            from omegaconf import OmegaConf

            self._pickled = pickle.dumps(OmegaConf.structured(made), protocol=pickle.HIGHEST_PROTOCOL)
            node_cache.store(self.name, made, self._pickled)
        return pickle.loads(self._pickled)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # ``ConfigStore.load`` deep-copies the node itself (``memo`` is still empty: this node is the copy's top):
        # that is Hydra loading it, so build it. Hydra also deep-copies its whole config repository, the
        # ConfigStore included, once per compose (``CachingConfigRepository``); there this node sits inside
        # the copy (``memo`` already holds its containers) and stays lazy: the node is never changed, so the
        # copy shares it. Building it there made every compose build every schema of the store, used or not.
        if memo:
            return self
        return self.node()

    def __getstate__(self) -> dict[str, Any]:
        return {"make": self.make, "name": self.name, "_pickled": None}


def store_lazily(
    name: str, make: Callable[[], Any], group: str | None = None, package: str | None = None
) -> None:
    """What ``ConfigStore.store`` does, with the node made on first use (:class:`LazyNode`)."""
    where = ConfigStore.instance().repo
    for part in group.split("/") if group else ():
        where = where.setdefault(part, {})
    file_name = f"{name}.yaml"
    where[file_name] = ConfigNode(
        name=file_name,
        node=LazyNode(make, f"{group or '_root'}.{name}".replace("/", ".")),  # type: ignore[arg-type]  # a DictConfig once ConfigStore.load deep-copies it
        group=group,
        package=package,
        provider=PROVIDER,
    )


def _model_conf() -> Any:
    from miles_sglang_plugin.config.schema import ModelConf

    return ModelConf


def _extra_group(worker_type: str) -> Any:
    from miles_sglang_plugin.config.deployment_spec import WorkerType
    from miles_sglang_plugin.config.schema import ExtraServerGroupConf

    return ExtraServerGroupConf(worker_type=WorkerType(worker_type))


def _deploy_default() -> Any:
    from miles_sglang_plugin.config.schema import SGLangDeployConf

    return SGLangDeployConf


def _deploy_simulated() -> Any:
    from miles_sglang_plugin.config.schema import EngineKind, LaunchConf, SGLangDeployConf

    return SGLangDeployConf(launch=LaunchConf(engine=EngineKind.simulated))


def _deploy_cpu_sglang() -> Any:
    from miles_sglang_plugin.config.schema import EngineKind, LaunchConf, SGLangDeployConf

    return SGLangDeployConf(launch=LaunchConf(engine=EngineKind.cpu_sglang))


def _trainer_mapping(trainer: str) -> Any:
    from miles_sglang_plugin.config.schema import SGLangTrainerConf
    from miles_sglang_plugin.config.trainer_mappings import TrainerKind

    return SGLangTrainerConf(trainer=TrainerKind(trainer))


def _trainer_args() -> Any:
    from miles_sglang_plugin.config.schema import MilesTrainerArgs

    return MilesTrainerArgs


#: The ``sglang_trainer`` options and their group (``TrainerKind``'s values and ``TRAINER_MAPPING_KEY``: a test
#: holds them equal; the mappings module is not imported at Hydra's plugin scan).
TRAINER_OPTIONS = ("verl", "skyrl")
_TRAINER_GROUP = "sglang_trainer"

#: The worker types of the ``sglang_group`` options (``WorkerType``'s values; a test holds them equal).
GROUP_OPTIONS = ("regular", "prefill", "decode", "placeholder")

_registered = False


def register_configs() -> None:
    """Store the schemas and register the ``msp.trainer`` resolver their defaults use (once per process;
    Hydra's plugin scan and the CLI both call this). Cheap: no schema is imported or built until Hydra loads
    one of them (:class:`LazyNode`)."""
    global _registered
    if _registered:
        return
    _registered = True
    register_resolvers()
    store_lazily("base", _model_conf, group="sglang_model")
    for worker_type in GROUP_OPTIONS:
        store_lazily(worker_type, functools.partial(_extra_group, worker_type), group="sglang_group")
    store_lazily("default", _deploy_default, group="sglang_deploy")
    store_lazily("simulated", _deploy_simulated, group="sglang_deploy")
    store_lazily("miles_trainer_args", _trainer_args)
    config_store = ConfigStore.instance()
    store_lazily("cpu_sglang", _deploy_cpu_sglang, group="sglang_deploy")
    for trainer in TRAINER_OPTIONS:
        store_lazily(trainer, functools.partial(_trainer_mapping, trainer), group=_TRAINER_GROUP)
    config_store.store(
        group="hydra/callbacks",
        name="sglang_cleanup",
        package="hydra.callbacks",
        node={"sglang_cleanup": {"_target_": "miles_sglang_plugin.app.callbacks.SGLangCleanupCallback"}},
        provider=PROVIDER,
    )
    config_store.store(
        group="hydra/callbacks",
        name="sglang_plan",
        package="hydra.callbacks",
        node={
            "sglang_plan": {
                "_target_": "miles_sglang_plugin.app.callbacks.SGLangPlanCallback",
                "commands": False,
            }
        },
        provider=PROVIDER,
    )


def config_search_path() -> str:
    """Where the ``sglang`` presets live: ``pkg://miles_sglang_plugin.conf`` in an installed wheel, the
    repository's top-level ``conf/`` in a source checkout (an editable install does not map it into the
    package)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("miles_sglang_plugin.conf") is not None:
        return "pkg://miles_sglang_plugin.conf"
    checkout_conf = Path(__file__).resolve().parents[2] / "conf"
    return f"file://{checkout_conf}"
