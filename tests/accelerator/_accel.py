"""``Accel``: what the ``accelerator`` fixture yields, one device-generic handle for sim and CUDA test bodies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

import pytest
import torch

__all__ = ["Accel", "accelerator_params", "on_accelerators", "swap_module_params"]

M = TypeVar("M", bound=torch.nn.Module)


def accelerator_params(min_devices: int = 1) -> list[Any]:
    """The ``accelerator`` fixture's parameters: ``"sim"`` (every run, 2 devices) and ``"cuda"``, marked ``cuda`` and,
    for a test that needs ``min_devices >= 2``, ``multigpu`` (skipped with fewer GPUs; the sim variant still runs)."""
    marks = [pytest.mark.cuda, *([pytest.mark.multigpu] if min_devices >= 2 else [])]
    return ["sim", pytest.param("cuda", marks=marks)]


def on_accelerators(min_devices: int) -> pytest.MarkDecorator:
    """``@on_accelerators(2)``: the test's ``accelerator`` runs on sim and on CUDA, that one marked ``multigpu``."""
    return pytest.mark.parametrize("accelerator", accelerator_params(min_devices), indirect=True)


@contextmanager
def swap_module_params() -> Iterator[None]:
    """For the block, ``Module.to()`` keeps each Parameter object on any device (FACTS 28): CPU<->CUDA moves do so
    anyway; a PrivateUse1 device needs ``torch.__future__.set_swap_module_params_on_conversion(True)``. Set only
    around the move, never globally: it also makes ``load_state_dict`` swap tensors, which fails under DDP."""
    before = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(before)


@dataclass(frozen=True)
class Accel:
    """The accelerator a test runs on: ``type`` ("sim" or "cuda") and ``count`` usable devices.

    Everything goes through ``torch.accelerator`` and ``torch.get_device_module(type)``, so a test body written
    against it runs unchanged on the test accelerator and on CUDA.
    """

    type: str
    count: int

    def device(self, index: int = 0) -> torch.device:
        """``torch.device(type, index)``; IndexError past ``count``."""
        if not 0 <= index < self.count:
            raise IndexError(f"{self.type}:{index} asked for, {self.count} device(s) available")
        return torch.device(self.type, index)

    @property
    def module(self) -> ModuleType:
        """``torch.get_device_module(type)``: ``torch.sim`` or ``torch.cuda``."""
        module: ModuleType = torch.get_device_module(self.type)
        return module

    def move(self, module: M, index: int = 0) -> M:
        """``module.to(device(index))`` as a user's ``model.to("cuda")`` after building the optimizer: the same
        Parameter objects, now on the device (:func:`swap_module_params`), on sim as on CUDA."""
        with swap_module_params():
            return module.to(self.device(index))

    def need(self, count: int) -> None:
        """Skip the test unless at least ``count`` devices are available (a 1-GPU CUDA runner)."""
        if self.count < count:
            pytest.skip(f"needs {count} {self.type} devices, {self.count} available")

    def memory_allocated(self, index: int = 0) -> int:
        """Bytes held by live tensors on device ``index``."""
        return torch.accelerator.memory_allocated(index)

    def max_memory_allocated(self, index: int = 0) -> int:
        """Peak bytes on device ``index`` since the last ``reset_peak_memory_stats``."""
        return torch.accelerator.max_memory_allocated(index)

    def reset_peak_memory_stats(self, index: int = 0) -> None:
        """Restart peak tracking on device ``index``."""
        torch.accelerator.reset_peak_memory_stats(index)

    def synchronize(self) -> None:
        """Wait for the current device's work (a no-op on sim)."""
        torch.accelerator.synchronize()
