"""Importing this module makes the test accelerator this process's accelerator, as importing a device's torch plugin
(``torch_npu``, Habana's bridge) registers theirs: for scripts that import a plugin module by name, e.g.
``launch/train.py --plugin dist_resume.testing.sim.plugin``.

The process needs :func:`dist_resume.testing.sim.worker_env` in its environment (or builds the library on first use);
``sim:LOCAL_RANK`` is then the current device. ``DEVICE`` is that device.
"""

from __future__ import annotations

from ..._sim.boot import boot

__all__ = ["DEVICE"]

DEVICE = boot()
