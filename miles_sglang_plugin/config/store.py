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

from hydra.core.config_store import ConfigStore

from miles_sglang_plugin.config.deployment_spec import WorkerType
from miles_sglang_plugin.config.locating import register_resolvers
from miles_sglang_plugin.config.schema import (
    EngineKind,
    ExtraServerGroupConf,
    LaunchConf,
    MilesTrainerArgs,
    ModelConf,
    SGLangDeployConf,
    SGLangTrainerConf,
)
from miles_sglang_plugin.config.trainer_mappings import TRAINER_MAPPING_KEY, TrainerKind

PROVIDER = "miles_sglang_plugin"


_registered = False


def register_configs() -> None:
    """Store the schemas and register the ``msp.trainer`` resolver their defaults use (once per process;
    Hydra's plugin scan and the CLI both call this)."""
    global _registered
    if _registered:
        return
    _registered = True
    register_resolvers()
    config_store = ConfigStore.instance()
    config_store.store(group="sglang_model", name="base", node=ModelConf, provider=PROVIDER)
    for worker_type in WorkerType:
        config_store.store(
            group="sglang_group",
            name=worker_type.value,
            node=ExtraServerGroupConf(worker_type=worker_type),
            provider=PROVIDER,
        )
    config_store.store(group="sglang_deploy", name="default", node=SGLangDeployConf, provider=PROVIDER)
    config_store.store(
        group="sglang_deploy",
        name="simulated",
        node=SGLangDeployConf(launch=LaunchConf(engine=EngineKind.simulated)),
        provider=PROVIDER,
    )
    config_store.store(
        group="sglang_deploy",
        name="cpu_sglang",
        node=SGLangDeployConf(launch=LaunchConf(engine=EngineKind.cpu_sglang)),
        provider=PROVIDER,
    )
    config_store.store(name="miles_trainer_args", node=MilesTrainerArgs, provider=PROVIDER)
    for trainer in TrainerKind:
        config_store.store(
            group=TRAINER_MAPPING_KEY,
            name=trainer.value,
            node=SGLangTrainerConf(trainer=trainer),
            provider=PROVIDER,
        )
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
