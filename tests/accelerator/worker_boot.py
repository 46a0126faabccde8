"""First lines of a torchrun worker that runs on the test accelerator.

The launching test puts ``worker_env()`` (``DIST_RESUME_SIM_LIB``, ``DIST_RESUME_SIM_DEVICES``, ``PYTHONPATH``) in the
environment; the worker script then calls ``boot()`` before it touches a tensor::

    from tests.accelerator.worker_boot import boot
    device = boot()  # torch.device("sim", LOCAL_RANK), now current; simgloo registered for init_process_group

Loading takes milliseconds: the library is built already and nothing is compiled here. Calling it before any backward
pass also gives autograd its per-device worker threads, as on CUDA.
"""

from __future__ import annotations

import os

import torch

from tests.accelerator._activate import activate

__all__ = ["boot"]


def boot() -> torch.device:
    """Activate the test accelerator in this process and make ``sim:LOCAL_RANK`` current; return that device."""
    activate()
    device = torch.device("sim", int(os.environ.get("LOCAL_RANK", "0")))
    torch.accelerator.set_device_index(device)
    return device
