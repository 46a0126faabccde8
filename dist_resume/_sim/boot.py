"""Starting a process on the test accelerator: ``boot()`` in the process, ``worker_env()`` for the ones it starts.

A process started with ``worker_env()`` in its environment (``DIST_RESUME_SIM_LIB``: the built library, so nothing is
compiled there; ``DIST_RESUME_SIM_DEVICES``) calls ``boot()`` before it touches a tensor::

    from dist_resume.testing.sim import boot
    device = boot()  # torch.device("sim", LOCAL_RANK), now current; simgloo registered for init_process_group

or imports ``dist_resume.testing.sim.plugin``, which does the same. With ``worker_env(autoload=True)`` it does nothing
at all: every Python process of that environment boots when it imports torch (what ``dist-resume check --device sim``
gives a user's unchanged command; see :mod:`.autoload`).

Loading takes milliseconds. Calling it before any backward pass also gives autograd its per-device worker threads,
as on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from .activate import DEVICES_ENV, activate
from .build import LIB_ENV, build

__all__ = ["SITECUSTOMIZE", "boot", "startup_dir", "worker_env"]

SITECUSTOMIZE = "dist_resume._sim.startup.sitecustomize"  # what Python's site imports: it calls autoload.install()


def startup_dir() -> Path:
    """The folder to put first on ``PYTHONPATH`` for ``autoload``: the one holding :data:`SITECUSTOMIZE` (found
    without importing it)."""
    spec = importlib.util.find_spec(SITECUSTOMIZE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"{SITECUSTOMIZE} is missing from the installed package: reinstall dist-resume")
    return Path(spec.origin).parent


def boot() -> torch.device:
    """Activate the test accelerator in this process and make ``sim:LOCAL_RANK`` current; return that device.

    Local. Loads the library built already (``$DIST_RESUME_SIM_LIB``, else the cache: it is built there first if
    needed).
    """
    activate()
    device = torch.device("sim", int(os.environ.get("LOCAL_RANK", "0")))
    torch.accelerator.set_device_index(device)
    return device


def worker_env(num_devices: int = 2, *, autoload: bool = False) -> dict[str, str]:
    """The variables a process needs to boot the test accelerator without building it: the built library's path
    and the device count (builds first if needed). Local.

    ``autoload=True`` adds a ``PYTHONPATH`` (this environment's, after) whose ``sitecustomize`` boots every Python
    process that imports torch, so that a script runs on ``sim:LOCAL_RANK`` unchanged.
    """
    env = {LIB_ENV: str(build()), DEVICES_ENV: str(num_devices)}
    if autoload:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(startup_dir()), os.environ.get("PYTHONPATH")]))
    return env
