"""Backends: where a plan's nodes run and how engine processes are started and stopped there.

``sglang_deploy.launch.backend`` selects one by name (:func:`get_backend`); every backend implements
:class:`~miles_sglang_plugin.backends.base.Backend`. What backends share: child processes that are always
cleaned up (:mod:`.processes`) and the live start-up view (:mod:`.status_view`).
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # at run time these load on first use: a Ray actor imports its own module of this package
    from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError, UnsupportedPlanError

#: The interface's names, importable from here, loaded from :mod:`.base` on first use.
_INTERFACE = ("Backend", "EngineProcess", "LaunchError", "UnsupportedPlanError")

#: Backend name -> ``module:class``, imported only when chosen (a backend may need an optional extra).
BACKENDS: dict[str, str] = {
    "local": "miles_sglang_plugin.backends.local:LocalBackend",
    "ray": "miles_sglang_plugin.backends.ray_backend:RayBackend",
}


def get_backend(name: str, **options: Any) -> Backend:
    """A new backend of kind ``name`` (a value of ``sglang_deploy.launch.backend``), constructed with
    ``options`` (e.g. ``placement_group=`` for ``ray``). A backend whose optional extra is missing raises
    :class:`~miles_sglang_plugin.errors.DeploymentConfigError` naming it."""
    try:
        target = BACKENDS[str(name)]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    backend_class = getattr(importlib.import_module(module), cls)
    accepted = inspect.signature(backend_class).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"the {name} backend takes no option {', '.join(unknown)}"
            + (f" (it takes: {', '.join(accepted)})" if accepted else "")
        )
    backend: Backend = backend_class(**options)
    return backend


def __getattr__(name: str) -> Any:
    if name not in _INTERFACE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("miles_sglang_plugin.backends.base"), name)
    globals()[name] = value
    return value


__all__ = ["BACKENDS", "Backend", "EngineProcess", "LaunchError", "UnsupportedPlanError", "get_backend"]
