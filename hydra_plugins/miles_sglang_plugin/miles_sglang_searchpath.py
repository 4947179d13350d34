"""Hydra plugin of miles_sglang_plugin: puts the ``sglang`` config group on every Hydra app's search path.

Hydra imports every module here at start-up of every app, so this stays tiny: no heavy imports, no warnings.
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from miles_sglang_plugin.config.store import config_search_path, register_configs

register_configs()


class MilesSGLangSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="miles_sglang_plugin", path=config_search_path())
