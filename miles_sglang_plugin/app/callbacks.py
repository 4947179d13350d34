"""Hydra callbacks of the group.

- ``hydra/callbacks=sglang_cleanup``: stops any deployment a job left running, at the end of each job (multirun
  included). ``launch_from_config`` used as a ``with`` block already stops its deployment; this is the safety
  net for code that does not.
- ``hydra/callbacks=sglang_plan``: the app's own dry run, like ``--cfg job``: the app's composed config is
  resolved and its plan printed (``hydra.callbacks.sglang_plan.commands=true`` adds the command lines), and the
  app's task does not run: nothing starts. Exit status 0, or 2 with every problem listed. With ``-m`` each job
  of the sweep is planned the same way (the callback gives the sweep the plan launcher of the group's Hydra
  plugin), and the sweep exits 2 if any job's plan fails.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

EXIT_USER_ERROR = 2
#: The launcher a dry-run sweep uses: it plans each job instead of running it (a Hydra plugin must live in the
#: hydra_plugins namespace).
PLAN_LAUNCHER = "hydra_plugins.miles_sglang_plugin.miles_sglang_plan_launcher.SGLangPlanLauncher"


class SGLangCleanupCallback(Callback):
    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        from miles_sglang_plugin.serving.deployment import stop_all_active

        stop_all_active()


def print_plan_of(config: DictConfig, *, commands: bool = False) -> bool:
    """Resolve ``config`` (an app's composed config, its ``hydra`` node included) and print its plan, or every
    problem; whether it resolved. Nothing is started."""
    from rich.console import Console

    from miles_sglang_plugin.app.hydra_edge import prepare_from_config
    from miles_sglang_plugin.errors import DeploymentConfigError
    from miles_sglang_plugin.planning.views import print_plan
    from miles_sglang_plugin.rendering.server_arg_fields import known_server_arg_fields
    from miles_sglang_plugin.rendering.views import print_commands

    try:
        prepared = prepare_from_config(config)
    except DeploymentConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return False
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    print_plan(prepared.plan, console)
    if commands:
        print_commands(prepared.launch, console)
    console.print(f"override keys checked against {known_server_arg_fields().source}", markup=False)
    for note in prepared.launch.notes:
        console.print(f"note: {note}", markup=False)
    return True


class SGLangPlanCallback(Callback):
    """The dry run (``hydra/callbacks=sglang_plan``); ``commands``: print each engine's command line too."""

    def __init__(self, commands: bool = False) -> None:
        self.commands = commands

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.hydra_config import HydraConfig

        HydraConfig.instance().set_config(config)  # for ${hydra:...} in the app's config, as in its job
        ok = print_plan_of(config, commands=self.commands)
        raise SystemExit(0 if ok else EXIT_USER_ERROR)  # the task does not run; Hydra lets SystemExit through

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra_plugins.miles_sglang_plugin.miles_sglang_plan_launcher import SGLangPlanLauncher

        SGLangPlanLauncher.failed_jobs.clear()
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.launcher = OmegaConf.create({"_target_": PLAN_LAUNCHER, "commands": self.commands})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra_plugins.miles_sglang_plugin.miles_sglang_plan_launcher import SGLangPlanLauncher

        if SGLangPlanLauncher.failed_jobs:
            jobs = ", ".join(f"#{idx}" for idx in SGLangPlanLauncher.failed_jobs)
            print(f"error: the plans of job(s) {jobs} have problems (listed above)", file=sys.stderr)
            raise SystemExit(EXIT_USER_ERROR)
