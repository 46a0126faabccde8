"""Importing this module makes the test accelerator this process's accelerator, as importing a device's torch plugin
(``torch_npu``, Habana's bridge) registers theirs: for scripts that import a plugin module by name, e.g.
``launch/train.py --plugin tests.accelerator.plugin`` (scripts/ci_multigpu.sh's flow without GPUs).

The process needs ``worker_env()`` in its environment (the built library, the device count, a ``PYTHONPATH`` that
finds ``tests``); ``sim:LOCAL_RANK`` is then the current device (``worker_boot.boot()``). Nothing is compiled here.
"""

from __future__ import annotations

from tests.accelerator.worker_boot import boot

DEVICE = boot()
