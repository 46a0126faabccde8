"""``torch.sim``: the device module torch finds for the test accelerator (``torch.get_device_module("sim")``).

torch's device-generic Python code asks this module, not the C++ library, whether the device is usable:
``torch.accelerator.is_available()`` and ``device_count()`` call ``is_available()`` and ``device_count()`` here,
``torch.load`` checks them before restoring a ``sim:i`` storage, ``torch.manual_seed`` calls ``manual_seed_all``
(only if ``_is_in_bad_fork`` exists), ``torch.random.fork_rng(device_type="sim")`` uses the RNG functions and
``torch.utils.checkpoint`` enters ``device(i)``. Both counts read the library's *enabled* count, which
``dist_resume.testing.sim.enabled()`` switches at run time, so a disabled accelerator reads as a CPU-only machine.
Everything here is local to the process.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

__all__ = [
    "current_device",
    "device",
    "device_count",
    "get_rng_state",
    "get_rng_state_all",
    "initial_seed",
    "is_available",
    "is_initialized",
    "manual_seed",
    "manual_seed_all",
    "max_memory_allocated",
    "memory_allocated",
    "memory_stats",
    "reset_peak_memory_stats",
    "seed",
    "seed_all",
    "set_device",
    "set_rng_state",
    "set_rng_state_all",
    "synchronize",
]

DeviceLike = torch.device | str | int | None


def _ops() -> Any:
    return torch.ops.sim_backend


def _index(device: DeviceLike) -> int:
    """A device index: ``None``, ``"sim"`` and ``torch.device("sim")`` mean the current device."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    dev = torch.device(device)
    if dev.type != "sim":
        raise ValueError(f"expected a sim device, got {dev}")
    return current_device() if dev.index is None else dev.index


def is_available() -> bool:
    """True while at least one sim device is enabled."""
    return bool(_ops().enabled_devices() > 0)


def is_initialized() -> bool:
    """Always True: the devices need no lazy initialisation."""
    return True


def _is_in_bad_fork() -> bool:
    """False: forked children can use the devices (they are host memory)."""
    return False


def device_count() -> int:
    """How many sim devices are enabled now (0 while the accelerator is off)."""
    return int(_ops().enabled_devices())


def current_device() -> int:
    """This thread's current sim device index (as ``torch.cuda.current_device``)."""
    return torch.accelerator.current_device_index()


def set_device(device: DeviceLike) -> None:
    """Make ``device`` this thread's current sim device."""
    torch.accelerator.set_device_index(_index(device))


class device:  # the name torch looks up: torch.get_device_module("sim").device(i)
    """Context manager: ``with torch.sim.device(1):`` makes sim:1 current, then restores the previous device."""

    def __init__(self, device: DeviceLike) -> None:
        self.idx = -1 if device is None else _index(device)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = current_device()
        if self.idx >= 0:
            set_device(self.idx)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self.idx >= 0:
            set_device(self.prev)


def synchronize(device: DeviceLike = None) -> None:
    """A no-op, as everything runs synchronously; validates ``device``."""
    torch.accelerator.synchronize(_index(device))


def get_rng_state(device: DeviceLike = "sim") -> torch.Tensor:
    """The state of ``device``'s default generator (a CPU uint8 tensor, as ``torch.cuda.get_rng_state``)."""
    state: torch.Tensor = _ops().get_rng_state(_index(device))
    return state


def set_rng_state(new_state: torch.Tensor, device: DeviceLike = "sim") -> None:
    """Restore ``device``'s default generator from ``get_rng_state``'s tensor."""
    _ops().set_rng_state(_index(device), new_state.to("cpu", torch.uint8))


def get_rng_state_all() -> list[torch.Tensor]:
    """The states of every enabled device's generator."""
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    """Restore every device's generator, in index order."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator."""
    _ops().manual_seed(current_device(), int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator (also the disabled ones: ``torch.manual_seed`` calls this)."""
    for i in range(int(_ops().device_count_at_load())):
        _ops().manual_seed(i, int(seed))


def seed() -> None:
    """Seed the current device's generator with a non-deterministic number (the CPU generator is left alone)."""
    manual_seed(secrets.randbits(63))


def seed_all() -> None:
    """Seed every device's generator with one non-deterministic number."""
    manual_seed_all(secrets.randbits(63))


def initial_seed() -> int:
    """The current device generator's seed."""
    return int(_ops().initial_seed(current_device()))


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes held by live tensors on ``device`` (``torch.accelerator.memory_allocated``)."""
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak bytes on ``device`` since the start or the last ``reset_peak_memory_stats``."""
    return torch.accelerator.max_memory_allocated(_index(device))


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Start peak tracking on ``device`` again from its current allocation."""
    torch.accelerator.reset_peak_memory_stats(_index(device))


def memory_stats(device: DeviceLike = None) -> dict[str, Any]:
    """``torch.accelerator.memory_stats`` for ``device``."""
    return dict(torch.accelerator.memory_stats(_index(device)))
