"""The launcher of the group's dry run in a multirun (``-m hydra/callbacks=sglang_plan ...``): each job of the
sweep is composed as Hydra's basic launcher composes it, and its plan printed instead of running the app's
task. The ``sglang_plan`` callback selects it; nothing else does.

Hydra imports this module at start-up of every app (its plugin scan), so it imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from hydra.plugins.launcher import Launcher


class SGLangPlanLauncher(Launcher):
    #: Indices of the jobs whose plan failed, in this process (the callback reports them when the sweep ends).
    failed_jobs: ClassVar[list[int]] = []

    def __init__(self, commands: bool = False) -> None:
        self.commands = commands
        self.config: Any = None
        self.hydra_context: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.config = config
        self.hydra_context = hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from hydra.core.hydra_config import HydraConfig
        from hydra.core.utils import JobReturn, JobStatus, filter_overrides, setup_globals
        from omegaconf import open_dict

        from miles_sglang_plugin.app.callbacks import print_plan_of
        from miles_sglang_plugin.masking import mask_overrides

        setup_globals()
        returns = []
        for offset, overrides in enumerate(job_overrides):
            idx = initial_job_idx + offset
            print(f"#{idx} : {' '.join(mask_overrides(filter_overrides(overrides)))}", flush=True)
            sweep_config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(sweep_config):
                sweep_config.hydra.job.id = idx
                sweep_config.hydra.job.num = idx
            HydraConfig.instance().set_config(sweep_config)
            if not print_plan_of(sweep_config, commands=self.commands):
                self.failed_jobs.append(idx)
            returns.append(JobReturn(overrides=mask_overrides(overrides), status=JobStatus.COMPLETED))
        return returns
