"""Composition for the ``miles-sglang`` command (Hydra's compose API, outside any ``@hydra.main`` app)."""

from __future__ import annotations

from collections.abc import Sequence

from omegaconf import DictConfig

from miles_sglang_plugin.config.store import config_search_path, register_configs

PRIMARY_CONFIG = "miles_sglang"


class CompositionError(ValueError):
    """A Hydra override or config that does not compose; the message is Hydra's, without a traceback."""


def _describe(exc: BaseException) -> str:
    parts = []
    seen: set[str] = set()
    current: BaseException | None = exc
    while current is not None:
        text = str(current).strip()
        if text and text not in seen:
            parts.append(text)
            seen.add(text)
        current = current.__cause__
    return "\n".join(parts)


def compose_config(overrides: Sequence[str], config_name: str = PRIMARY_CONFIG) -> DictConfig:
    """Compose the command's primary config (Miles' trainer arguments + the ``sglang`` group) with overrides."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    register_configs()
    location = config_search_path()
    GlobalHydra.instance().clear()
    try:
        if location.startswith("pkg://"):
            ctx = initialize_config_module(config_module=location[len("pkg://") :], version_base=None)
        else:
            ctx = initialize_config_dir(config_dir=location[len("file://") :], version_base=None)
        with ctx:
            return compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as exc:
        raise CompositionError(_describe(exc)) from None
    finally:
        GlobalHydra.instance().clear()
