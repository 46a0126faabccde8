"""The test accelerator for this repository's tests: ``dist_resume.testing.sim`` (the installed package's simulated
``sim`` devices and ``simgloo`` backend) plus the pytest pieces built on it.

Builds go to ``tests/accelerator/.build/<key>/`` (git-ignored) unless ``$DIST_RESUME_SIM_CACHE`` says otherwise.

In-process tests use the ``accelerator`` fixture (tests/conftest.py), which calls ``enabled(2)`` around the test. A
torchrun worker script starts with::

    from tests.accelerator.worker_boot import boot
    device = boot()  # activate(), then sim:LOCAL_RANK is this process's current device

and is launched with ``worker_env()`` (the ``sim_worker_env`` fixture) in its environment.

API (all local to the calling process): what ``dist_resume.testing.sim`` exports, ``worker_env()`` with a
``PYTHONPATH`` that also finds ``tests``, and
    Accel(type, count)            what the fixture yields: device(i), module, move(module, i), need(n), ...
    swap_module_params()          context manager: Module.to() keeps the Parameter objects, as CPU<->CUDA does
    on_accelerators(n)            decorator: the accelerator fixture's params, the CUDA one marked multigpu for n >= 2
"""

from __future__ import annotations

import os

from dist_resume._sim import build as _build  # the build module itself: its self-test patches its source and cache
from dist_resume.testing import sim as _sim
from dist_resume.testing.sim import (
    BACKEND,
    CACHE_ENV,
    DEVICE_TYPE,
    DEVICES_ENV,
    LIB_ENV,
    activate,
    build,
    disable,
    enabled,
    enabled_count,
    engine_has_threads,
    unavailable_reason,
)
from dist_resume.testing.sim import SimBuildError as BuildError
from tests.accelerator._accel import Accel, accelerator_params, on_accelerators, swap_module_params

__all__ = [
    "_build",
    "BACKEND",
    "Accel",
    "accelerator_params",
    "DEVICES_ENV",
    "DEVICE_TYPE",
    "LIB_ENV",
    "BuildError",
    "activate",
    "build",
    "build_seconds",
    "disable",
    "enabled",
    "enabled_count",
    "engine_has_threads",
    "on_accelerators",
    "swap_module_params",
    "unavailable_reason",
    "worker_env",
]

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault(CACHE_ENV, os.path.join(REPO_ROOT, "tests", "accelerator", ".build"))
build_seconds = _build.build_seconds  # wall time of builds done (or waited for) by this process, for reports


def worker_env(num_devices: int = 2) -> dict[str, str]:
    """``dist_resume.testing.sim.worker_env`` plus a ``PYTHONPATH`` that finds ``tests`` and ``dist_resume``."""
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return {**_sim.worker_env(num_devices), "PYTHONPATH": path}
