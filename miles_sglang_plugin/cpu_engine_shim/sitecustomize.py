"""Run at interpreter start of a ``cpu_sglang`` engine (this directory is first on its ``PYTHONPATH``; see
README.md): once ``torch`` is imported, ``torch.get_device_module()`` without an argument answers ``torch.cpu``
when CUDA has no device (a CUDA build of torch answers ``torch.cuda`` there, and SGLang's memory release calls
its ``synchronize()``, which needs an NVIDIA driver). Then any other ``sitecustomize`` on the path is run, as
if this one were not there."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

HERE = os.path.dirname(os.path.abspath(__file__))


def patch_device_module(torch: Any) -> None:
    """``torch.get_device_module(None)``: ``torch.cpu`` when ``torch.cuda.is_available()`` is false."""
    original = torch.get_device_module
    if getattr(original, "_cpu_shim", False):
        return

    def get_device_module(device: Any = None) -> ModuleType:
        if device is None and not torch.cuda.is_available():
            return cast(ModuleType, torch.cpu)
        return cast(ModuleType, original(device))

    get_device_module._cpu_shim = True  # type: ignore[attr-defined]  # a marker attribute on the function
    torch.get_device_module = get_device_module


class _PatchTorchOnImport(importlib.abc.MetaPathFinder):
    """Finds ``torch`` as the other finders do and patches it right after its module has run."""

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # one use: let the normal finders find torch
        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        run_module = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            patch_device_module(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this one loader instance only
        return spec


def _run_next_sitecustomize() -> None:
    """The ``sitecustomize`` this one shadows (a distribution's or a virtual environment's), if any."""
    others = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if "torch" in sys.modules:
    patch_device_module(sys.modules["torch"])
else:
    sys.meta_path.insert(0, _PatchTorchOnImport())
_run_next_sitecustomize()
