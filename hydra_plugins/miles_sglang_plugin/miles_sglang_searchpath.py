"""Hydra plugin of miles_sglang_plugin: puts the ``sglang`` config group on every Hydra app's search path.

Hydra imports every module here at start-up of every app, so this stays tiny: no heavy imports, no warnings.
Its hook also checks the app's overrides before Hydra composes them (``sglang=null``, names too long for
Hydra's file lookups, helper groups without their package), so that those are one clean error with exit
status 2 instead of Hydra's traceback, and an override on a model the group does not have names the form that
adds one (:mod:`miles_sglang_plugin.config.model_forms`). An app's ``--help`` names the group at the package the app placed it
(:mod:`miles_sglang_plugin.config.app_help`).
"""

from hydra.core.config_search_path import ConfigSearchPath
from hydra.plugins.search_path_plugin import SearchPathPlugin

from miles_sglang_plugin.config.app_help import install_help_placement
from miles_sglang_plugin.config.model_forms import install_model_form_messages
from miles_sglang_plugin.config.overrides import check_app_overrides
from miles_sglang_plugin.config.store import config_search_path, register_configs

register_configs()
install_help_placement()
install_model_form_messages()


class MilesSGLangSearchPathPlugin(SearchPathPlugin):
    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append(provider="miles_sglang_plugin", path=config_search_path())
        check_app_overrides()
