"""Hydra plugin of miles_sglang_plugin's sweeps: the ``sglang_packed`` launcher, the ``sglang_bench`` group and
the ``sglang_sweep_report`` callback.

Hydra imports this module at start-up of every app: it registers plain dataclasses and defines the launcher
class, whose work lives in :mod:`miles_sglang_plugin.sweeps.packing`, imported when a sweep launches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hydra.plugins.launcher import Launcher

from miles_sglang_plugin.sweeps.conf import register_sweep_configs

register_sweep_configs()


class PackedLauncher(Launcher):
    """``hydra/launcher=sglang_packed``: sweep jobs side by side on disjoint GPU sets (see the README)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = settings
        self.hydra_context: Any = None
        self.task_function: Any = None
        self.config: Any = None

    def setup(self, *, hydra_context: Any, task_function: Any, config: Any) -> None:
        self.hydra_context, self.task_function, self.config = hydra_context, task_function, config

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
        from miles_sglang_plugin.sweeps.packing import launch

        return launch(self, job_overrides, initial_job_idx)
