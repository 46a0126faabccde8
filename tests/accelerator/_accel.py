"""``Accel``: what the ``accelerator`` fixture yields, one device-generic handle for sim and CUDA test bodies."""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import pytest
import torch

__all__ = ["Accel"]


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
