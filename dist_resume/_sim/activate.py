"""Load the test accelerator into this process and switch its devices on and off. Everything here is local."""

from __future__ import annotations

import atexit
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.backend_registration import (
    generate_methods_for_privateuse1_backend,
    rename_privateuse1_backend,
)

from . import DEVICE_TYPE, device_module, process_group
from .build import build

__all__ = ["DEVICES_ENV", "DEVICE_TYPE", "activate", "disable", "enabled", "enabled_count", "engine_has_threads"]

DEVICES_ENV = "DIST_RESUME_SIM_DEVICES"  # devices that exist in a process; read once, when the library loads
DEFAULT_DEVICES = 2

_lock = threading.Lock()
_loaded = False
_engine_threads = True


def _env_devices() -> int:
    text = os.environ.get(DEVICES_ENV, "")
    return int(text) if text.strip().isdigit() and int(text) >= 1 else DEFAULT_DEVICES


def _probe_engine() -> bool:
    """Whether autograd has worker threads for sim devices. The engine sizes them once, at the first backward of the
    process: one that ran before the library loaded has none, and a backward on sim then fails an internal assert.

    The probe calls the engine directly: ``torch.autograd.backward`` stashes a ``contextvars.Context`` in the task's
    thread-local state, and the device thread drops that task just after the caller returns; if the interpreter is
    already finalising then (a script that exits at once), taking the GIL for the decref aborts the process
    ("terminate called without an active exception") in torch 2.13, on any device with autograd worker threads.
    """
    try:
        _engine_backward(0)
    except RuntimeError as err:
        if "device_ready_queues_" not in str(err):
            raise
        return False
    return True


def _engine_backward(index: int) -> None:
    """A one-node backward on ``sim:index`` through the engine itself, with no Python object in its state."""
    x = torch.ones(1, device=torch.device(DEVICE_TYPE, index), requires_grad=True)
    y = (x * 2).sum()
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.run_backward((y,), (torch.ones_like(y),), False, False, (), allow_unreachable=True, accumulate_grad=True)


def _drain_engine() -> None:
    """At exit, before the interpreter finalises: one backward through each device's autograd worker thread.

    A user's ``torch.autograd.backward`` (``loss.backward()``) leaves its task to the device thread, which drops it
    just after the caller returns; the task's state holds a Python object, so dropping it takes the GIL. When the
    script ends right away, the drop can come while the interpreter finalises, and the thread is torn down inside a
    destructor: the process aborts with "terminate called without an active exception" (torch 2.13). Each thread
    handles its queue in order, so once this backward on every device returns (the GIL released while it waits), the
    earlier task has been dropped.
    """
    ops = torch.ops.sim_backend
    ops.set_enabled_devices(ops.device_count_at_load())  # switched off by enabled()'s exit: on again, to reach them
    for index in range(int(ops.device_count_at_load())):
        _engine_backward(index)


def _load(num_devices: int | None) -> None:
    global _loaded, _engine_threads
    path = build()
    devices = max(num_devices or 0, _env_devices())
    previous = os.environ.get(DEVICES_ENV)
    os.environ[DEVICES_ENV] = str(devices)  # the library reads it while it loads
    try:
        torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    finally:
        if previous is None:
            del os.environ[DEVICES_ENV]
        else:
            os.environ[DEVICES_ENV] = previous
    rename_privateuse1_backend(DEVICE_TYPE)
    torch._register_device_module(DEVICE_TYPE, device_module)  # type: ignore[no-untyped-call]
    generate_methods_for_privateuse1_backend()
    process_group.register()
    _loaded = True
    _engine_threads = _probe_engine()
    if _engine_threads:
        atexit.register(_drain_engine)


def activate(num_devices: int | None = None) -> str:
    """Make ``sim`` this process's accelerator, with ``num_devices`` enabled (default: all, ``$DIST_RESUME_SIM_DEVICES``
    or 2), and return ``"sim"``.

    The first call loads the built library (``build()``: reused when built; ``$DIST_RESUME_SIM_LIB`` names it in
    sub-processes), renames PrivateUse1 to ``sim``, registers ``torch.sim`` and the Tensor/Module ``.sim()`` methods,
    and the ``simgloo`` process-group backend. Later calls only set the enabled count. Local to this process. Meant for
    worker processes; tests use the ``accelerator`` fixture or ``enabled()``, which switch it off again.
    """
    with _lock:
        if not _loaded:
            _load(num_devices)
        torch.ops.sim_backend.set_enabled_devices(
            num_devices if num_devices is not None else torch.ops.sim_backend.device_count_at_load()
        )
    return DEVICE_TYPE


def enabled_count() -> int:
    """How many sim devices are enabled now (0 when the library is not loaded or disabled)."""
    return int(torch.ops.sim_backend.enabled_devices()) if _loaded else 0


def disable() -> None:
    """Switch the accelerator off: ``torch.accelerator.is_available()`` is False and no sim tensor can be created.
    Existing sim tensors stay readable. A no-op when it was never activated."""
    if _loaded:
        torch.ops.sim_backend.set_enabled_devices(0)


def engine_has_threads() -> bool:
    """False when autograd started before the library loaded (see ``enabled``)."""
    return _engine_threads


@contextmanager
def enabled(num_devices: int = DEFAULT_DEVICES) -> Iterator[str]:
    """``with enabled(2):`` the accelerator is on with ``num_devices`` devices, sim:0 is current; afterwards the
    previous count (usually 0: off) and device are back. Yields ``"sim"``.

    In a process whose autograd engine started before the library loaded (a CPU test ran backward first), backward
    passes inside the block run on the calling thread (``torch.autograd.set_multithreading_enabled(False)``), as the
    engine has no worker thread for sim devices.
    """
    previous = enabled_count()
    activate(num_devices)
    prev_device = torch.accelerator.current_device_index()
    torch.accelerator.set_device_index(0)
    try:
        if _engine_threads:
            yield DEVICE_TYPE
        else:
            with torch.autograd.set_multithreading_enabled(False):
                yield DEVICE_TYPE
    finally:
        torch.accelerator.set_device_index(prev_device)
        torch.ops.sim_backend.set_enabled_devices(previous)
