"""The test accelerator: simulated devices on the CPU (device type ``sim``) for CI without GPUs.

A PrivateUse1 backend whose tensors live in host memory but carry ``sim:i`` devices, with per-device allocation
counters, a thread-local current device, per-device generators, and torch's own refusal of mixed-device inputs
("Expected all tensors to be on the same device"); plus ``simgloo``, a process-group backend for them (gloo behind a
CPU copy). With it, a script's device path (``<accelerator>:LOCAL_RANK``, ``map_location``, optimizer state on the
device, DDP under torchrun) runs against a real non-CPU device type on a CPU-only machine. It does not simulate
asynchrony, separate memory, NCCL or CUDA's numerics (docs/testing.md says what it does and does not).

The library is compiled from the C++ source shipped with the package on first use (ninja and a C++ compiler:
``pip install "dist-resume[sim]"``; about 15 s on 2 cores), cached by content in ``$DIST_RESUME_SIM_CACHE`` or
``~/.cache/dist_resume/sim``. It uses torch's unstable C++ headers: it is tested with torch 2.13. It stays off where
torch reports another accelerator, such as CUDA (``unavailable_reason()`` says why).

Three ways in, all local to the process they run in:

- ``dist-resume check --device sim -- COMMAND`` (or ``check_resume(..., device="sim")``): every Python process of
  COMMAND boots it when it imports torch, so an unchanged script runs on ``sim:LOCAL_RANK``.
- In a process: ``with enabled(2):`` (on for the block) or ``activate()``; ``boot()`` also makes
  ``sim:LOCAL_RANK`` current, and importing :data:`PLUGIN` (``dist_resume.testing.sim.plugin``) calls it: the module
  to name where a script imports a device's plugin by name (``launch/train.py --plugin``).
- For processes you start: ``worker_env()`` (the built library's path and the device count; ``autoload=True``
  boots them on ``import torch``).

Checkpoints saved on it carry ``sim:0``-style device tags: ``dist_resume`` reads them onto the reading process's own
device anywhere (``dist-resume inspect`` says where they came from); plain ``torch.load`` without ``map_location``
needs the accelerator active.

Example (CPU only; the first call builds the library)::

    >>> import torch
    >>> from dist_resume.testing import sim
    >>> with sim.enabled(2):  # doctest: +SKIP
    ...     t = torch.ones(2, device="sim:1")
    ...     torch.accelerator.device_count(), t.device
    (2, device(type='sim', index=1))
"""

from __future__ import annotations

from ..._core.errors import SimBuildError
from ..._sim.activate import DEVICE_TYPE, DEVICES_ENV, activate, disable, enabled, enabled_count, engine_has_threads
from ..._sim.boot import boot, worker_env
from ..._sim.build import CACHE_ENV, LIB_ENV, build, unavailable_reason
from ..._sim.process_group import BACKEND

PLUGIN = "dist_resume.testing.sim.plugin"  # importing it boots the test accelerator (a device plugin's way)

__all__ = [
    "PLUGIN",
    "DEVICE_TYPE",
    "BACKEND",
    "DEVICES_ENV",
    "LIB_ENV",
    "CACHE_ENV",
    "SimBuildError",
    "activate",
    "boot",
    "build",
    "disable",
    "enabled",
    "enabled_count",
    "engine_has_threads",
    "unavailable_reason",
    "worker_env",
]
