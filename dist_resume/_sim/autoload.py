"""Booting the test accelerator in every Python process of an environment, when the process imports torch.

``worker_env(autoload=True)`` puts the folder of ``dist_resume._sim.startup.sitecustomize`` first on ``PYTHONPATH``
(``boot.startup_dir()``); Python's ``site`` imports that module at start-up, and it calls :func:`install`. Nothing heavy happens then: a finder
first on ``sys.meta_path`` waits for ``import torch`` and, once torch has loaded, calls ``boot()`` (the built library
from ``$DIST_RESUME_SIM_LIB``; ``sim:LOCAL_RANK`` current). A ``sitecustomize`` further down ``sys.path`` (a
distribution's own) is then imported as it would have been. Local to each process.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["install"]


class _BootAfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: for ``torch``, wraps the real loader so that the accelerator boots after it ran."""

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if name != "torch":
            return None
        sys.meta_path.remove(self)  # once: the real finders answer from here on
        spec = importlib.util.find_spec(name)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_then_boot(module: ModuleType) -> None:
            run(module)
            from .boot import boot  # torch's: only now

            boot()

        loader.exec_module = exec_then_boot
        return spec


def _next_sitecustomize(here: str) -> None:
    """Import the ``sitecustomize`` that the one in ``here`` hides, if there is one."""
    me = sys.modules.pop("sitecustomize", None)
    saved = sys.path[:]
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ModuleNotFoundError as err:
        if err.name != "sitecustomize":
            raise
    finally:
        sys.path[:] = saved
        if me is not None:
            sys.modules["sitecustomize"] = me


def install(sitecustomize_file: str) -> None:
    """Boot on ``import torch`` from now on in this process (at once if torch is loaded), then import the
    ``sitecustomize`` that ``sitecustomize_file`` hides."""
    if "torch" in sys.modules:
        from .boot import boot

        boot()
    else:
        sys.meta_path.insert(0, _BootAfterTorch())
    _next_sitecustomize(os.path.dirname(os.path.abspath(sitecustomize_file)))
