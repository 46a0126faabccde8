"""The test accelerator: N simulated devices on the CPU (device type ``sim``) and a process-group backend for them.

Test infrastructure only (never in the installed package). ``sim_backend.cpp`` registers a PrivateUse1 backend whose
tensors live in host memory but carry ``sim:i`` devices, per-device allocation counters, a thread-local current
device and per-device generators, and which refuses mixed-device inputs with torch's own "Expected all tensors to be
on the same device" message. With it, placement code (map_location, optimizer-state devices, DDP under torchrun)
runs against a real non-CPU device type on a CPU-only machine.

In-process tests use the ``accelerator`` fixture (tests/conftest.py), which calls ``enabled(2)`` around the test. A
torchrun worker script starts with::

    from tests.accelerator.worker_boot import boot
    device = boot()  # activate(), then sim:LOCAL_RANK is this process's current device

and is launched with ``worker_env()`` (the ``sim_worker_env`` fixture) in its environment.

API (all local to the calling process):
    build() -> Path               build or reuse the library; BuildError on failure
    unavailable_reason() -> str | None   why it cannot be used here (no compiler, no ninja, a CUDA GPU present)
    activate(num_devices=None) -> "sim"  load it, rename PrivateUse1, register torch.sim and simgloo; idempotent
    enabled(num_devices=2)        context manager: on for the block, back off afterwards
    disable()                     off: torch.accelerator.is_available() is False again
    worker_env(num_devices=2) -> dict    environment a sub-process needs to activate() without building
    Accel(type, count)            what the fixture yields: device(i), module, move(module, i), need(n), ...
    swap_module_params()          context manager: Module.to() keeps the Parameter objects, as CPU<->CUDA does
    on_accelerators(n)            decorator: the accelerator fixture's params, the CUDA one marked multigpu for n >= 2
"""

from __future__ import annotations

import os

from tests.accelerator._accel import Accel, accelerator_params, on_accelerators, swap_module_params
from tests.accelerator._activate import (
    DEVICE_TYPE,
    DEVICES_ENV,
    activate,
    disable,
    enabled,
    enabled_count,
    engine_has_threads,
)
from tests.accelerator._build import LIB_ENV, BuildError, build, build_seconds, unavailable_reason
from tests.accelerator._pg import BACKEND, SimGlooProcessGroup

__all__ = [
    "BACKEND",
    "Accel",
    "accelerator_params",
    "DEVICES_ENV",
    "DEVICE_TYPE",
    "LIB_ENV",
    "BuildError",
    "SimGlooProcessGroup",
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


def worker_env(num_devices: int = 2) -> dict[str, str]:
    """The variables a sub-process (a torchrun worker) needs to ``activate()`` without building: the built library's
    path, the device count and a ``PYTHONPATH`` that finds ``tests`` and ``dist_resume``. Builds if needed."""
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return {LIB_ENV: str(build()), DEVICES_ENV: str(num_devices), "PYTHONPATH": path}
