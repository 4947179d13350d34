"""Backends: where a plan's nodes run and how engine processes are started and stopped there.

``sglang_deploy.launch.backend`` selects one by name (:func:`get_backend`); every backend implements
:class:`~miles_sglang_plugin.backends.base.Backend`. What backends share: child processes that are always
cleaned up (:mod:`.processes`) and the live start-up view (:mod:`.status_view`).
"""

from __future__ import annotations

import importlib

from miles_sglang_plugin.backends.base import Backend, EngineProcess, LaunchError, UnsupportedPlanError

#: Backend name -> ``module:class``, imported only when chosen (a backend may need an optional extra).
BACKENDS: dict[str, str] = {
    "local": "miles_sglang_plugin.backends.local:LocalBackend",
}


def get_backend(name: str) -> Backend:
    """A new backend of kind ``name`` (a value of ``sglang_deploy.launch.backend``)."""
    try:
        target = BACKENDS[str(name)]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; valid: {', '.join(BACKENDS)}") from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["BACKENDS", "Backend", "EngineProcess", "LaunchError", "UnsupportedPlanError", "get_backend"]
