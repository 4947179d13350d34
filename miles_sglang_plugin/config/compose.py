"""Composition for the ``miles-sglang`` command (Hydra's compose API, outside any ``@hydra.main`` app).

By default the command's own primary config (``miles_sglang``: Miles' trainer arguments at the root, the
``sglang`` group below); with ``config_dir`` / ``config_name`` an app's own primary config (``-cp`` / ``-cn``
of ``miles-sglang plan``), the group's presets on the search path as in every Hydra app.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from omegaconf import DictConfig

from miles_sglang_plugin.config.model_forms import install_model_form_messages
from miles_sglang_plugin.config.overrides import override_problems, render
from miles_sglang_plugin.config.store import config_search_path, register_configs
from miles_sglang_plugin.masking import mask_text, override_secret_values

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


def _where_asserted(exc: AssertionError) -> str:
    import traceback

    frame = traceback.extract_tb(exc.__traceback__)[-1]
    return f"an internal check of Hydra failed: {Path(frame.filename).name}:{frame.lineno} {frame.line}"


def _search_path_override(search_dirs: Sequence[str | Path]) -> list[str]:
    if not search_dirs:
        return []
    return [f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in search_dirs)}]"]


def compose_config(
    overrides: Sequence[str],
    config_name: str | None = PRIMARY_CONFIG,
    *,
    config_dir: str | Path | None = None,
    search_dirs: Sequence[str | Path] = (),
    return_hydra_config: bool = False,
) -> DictConfig:
    """Compose a primary config with overrides: the command's own (default), or ``config_name`` from
    ``config_dir`` (an app's config directory); ``search_dirs`` are added to the search path (``--config-dir``).
    With ``return_hydra_config`` the ``hydra`` node is kept (it records where the group was placed)."""
    from hydra import compose, initialize_config_dir, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    secrets = override_secret_values(overrides)  # Hydra's messages quote the overrides they are about
    problems = override_problems(overrides)
    if problems:
        raise CompositionError(mask_text(render(problems), secrets))
    register_configs()
    install_model_form_messages()
    location = f"file://{Path(config_dir).resolve()}" if config_dir is not None else config_search_path()
    GlobalHydra.instance().clear()
    try:
        ctx: AbstractContextManager[None]
        if location.startswith("pkg://"):
            ctx = initialize_config_module(config_module=location[len("pkg://") :], version_base=None)
        else:
            ctx = initialize_config_dir(config_dir=location[len("file://") :], version_base=None)
        with ctx:
            return compose(
                config_name=config_name,
                overrides=[*_search_path_override(search_dirs), *overrides],
                return_hydra_config=return_hydra_config,
            )
    except (HydraException, OmegaConfBaseException, OSError, ValueError) as exc:
        raise CompositionError(mask_text(_describe(exc), secrets)) from None
    except AssertionError as exc:  # Hydra asserts on some inputs (a group choice interpolated to a number)
        raise CompositionError(f"Hydra could not compose these overrides ({_where_asserted(exc)})") from None
    finally:
        GlobalHydra.instance().clear()
