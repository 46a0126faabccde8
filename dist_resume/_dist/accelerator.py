"""This process's accelerator: the one module that knows device types (cuda, xpu, npu, hpu, mps, PrivateUse1).

torch answers most questions itself through ``torch.accelerator`` (which device type, how many,
set the index, synchronise); ``torch.get_device_module(type)`` answers what that lacks (RNG state,
seeding). What torch keeps nowhere lives in the two tables below: the environment variable that
selects the visible devices, and the process-group backend built for each device type. No other
module of dist_resume names ``torch.cuda`` (tests/test_accelerator.py walks the package to prove it).

"The accelerator" is ``torch.accelerator.current_accelerator(check_available=True)``: one device type
per process, or none (then everything is on the CPU). :class:`Accelerator` is that answer as a value.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType, ModuleType
from typing import Any, Final

import torch
import torch.distributed as dist

from .._core.log import logger

__all__ = [
    "VISIBLE_DEVICES",
    "BACKENDS",
    "Accelerator",
    "current_accelerator",
    "visible_devices",
    "backend_for",
    "backend_serves",
    "set_device",
    "synchronize",
    "current_device",
    "pinned_staging",
    "register_host",
    "unregister_host",
    "device_rng_state",
    "set_device_rng_state",
    "seed_device",
]

# The environment variable(s) that choose which devices a process sees, per device type; the first is
# the one to name when none is set. ROCm builds report their GPUs as "cuda" and also honour HIP's variable.
# A type missing here (mps: one device, no such variable; a PrivateUse1 backend) has no known variable.
VISIBLE_DEVICES: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType(
    {
        "cuda": ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
        "xpu": ("ZE_AFFINITY_MASK", "ONEAPI_DEVICE_SELECTOR"),
        "npu": ("ASCEND_RT_VISIBLE_DEVICES",),
        "hpu": ("HABANA_VISIBLE_MODULES",),
    }
)

# The vendor's collective library per device type, used when torch.distributed has it (torch_npu and
# Habana's bridge register hccl when imported); otherwise torch's own Backend.default_device_backend_map
# (which third-party backends extend through Backend.register_backend), otherwise gloo.
BACKENDS: Final[Mapping[str, str]] = MappingProxyType({"cuda": "nccl", "xpu": "xccl", "npu": "hccl", "hpu": "hccl"})


@dataclass(frozen=True, slots=True)
class Accelerator:
    """This process's accelerator: its device ``type`` (``"cuda"``, ``"xpu"``, ``"sim"``...) and ``count``,
    the number of devices of that type this process sees (``mps``: 1)."""

    type: str
    count: int

    def visible_devices(self) -> tuple[str | None, str | None]:
        """(variable, value) of :func:`visible_devices` for this type."""
        return visible_devices(self.type)

    def describe(self) -> str:
        """``"2 visible cuda device(s) (CUDA_VISIBLE_DEVICES=4,5)"``: for messages that must say what was found."""
        name, value = self.visible_devices()
        where = f"{name}={value if value is not None else '<unset>'}" if name else "no visible-devices variable"
        return f"{self.count} visible {self.type} device(s) ({where})"


def current_accelerator() -> Accelerator | None:
    """The accelerator this process uses, or None when there is none (a CPU-only host). Local."""
    device = torch.accelerator.current_accelerator(check_available=True)
    if device is None:
        return None
    return Accelerator(device.type, int(torch.accelerator.device_count()))


def visible_devices(device_type: str) -> tuple[str | None, str | None]:
    """(name, value) of the environment variable that selects ``device_type``'s visible devices: the first
    of :data:`VISIBLE_DEVICES` that is set, else the first with value None; (None, None) for a type without one."""
    names = VISIBLE_DEVICES.get(device_type, ())
    for name in names:
        if name in os.environ:
            return name, os.environ[name]
    return (names[0], None) if names else (None, None)


def backend_for(device_type: str) -> str:
    """The process-group backend for ``device_type``: :data:`BACKENDS`' entry where torch.distributed has
    it, else torch's ``Backend.default_device_backend_map`` entry where available, else ``gloo``."""
    if device_type == "cpu" or not dist.is_available():
        return "gloo"
    for name in (BACKENDS.get(device_type), dist.Backend.default_device_backend_map.get(device_type)):
        if name and name != "fake" and dist.is_backend_available(name):
            return name
    return "gloo"


def backend_serves(backend: str, device_type: str) -> bool:
    """Whether torch says ``backend`` takes ``device_type`` tensors: its ``Backend.backend_capability``
    (which ``register_backend(..., devices=...)`` extends) or its default map (mps: gloo)."""
    if not dist.is_available():
        return device_type == "cpu"
    capable = dist.Backend.backend_capability.get(backend, [])
    return device_type in capable or dist.Backend.default_device_backend_map.get(device_type) == backend


def set_device(device: torch.device) -> None:
    """Make ``device`` this process's current accelerator device (``torch.accelerator.set_device_index``)."""
    torch.accelerator.set_device_index(device)


def synchronize(devices: Iterable[torch.device]) -> None:
    """Wait for the work queued on each of ``devices`` (``torch.accelerator.synchronize``); CPU devices need none."""
    for device in dict.fromkeys(devices):
        if device.type != "cpu":
            torch.accelerator.synchronize(device)


def current_device(device_type: str) -> torch.device:
    """The current device of ``device_type``: indexed for the accelerator, ``torch.device(device_type)`` otherwise."""
    acc = current_accelerator()
    if acc is not None and acc.type == device_type:
        return torch.device(device_type, torch.accelerator.current_device_index())
    return torch.device(device_type)


def pinned_staging(device_type: str) -> bool:
    """True when host copies of ``device_type`` tensors can live in pinned (page-locked) memory here."""
    acc = current_accelerator()
    return acc is not None and acc.type == device_type and _pins(device_type)


@functools.cache
def _pins(device_type: str) -> bool:
    # torch has no "supports pinned memory" query: a PrivateUse1 backend without a pinned allocator raises
    # RuntimeError, so ask by pinning one byte (once per process and device type)
    try:
        return bool(torch.empty(1, dtype=torch.uint8, pin_memory=True).is_pinned())
    except RuntimeError:
        return False


# Page-locking memory torch did not allocate: CUDA's cudaHostRegister (ROCm builds report their GPUs as "cuda" and bind
# hipHostRegister under the same name). torch offers it for no other device type. The flag is torch's own
# (torch.cuda._pin_memory_utils, used by DCP's staging): cudaHostRegisterPortable, pinned for every device.
_HOST_REGISTERS: Final = frozenset({"cuda"})
_HOST_REGISTER_PORTABLE: Final = 1


def register_host(address: int, nbytes: int, device_type: str) -> bool:
    """Page-lock the ``nbytes`` of host memory at ``address`` (memory this process mapped, not a torch allocation)
    for copies with ``device_type``'s devices, as torch's DCP staging does with shared memory
    (``_create_cpu_state_dict(pin_memory=True, share_memory=True)``): a copy from a device into it can then run
    without blocking. True when done; :func:`unregister_host` undoes it, before the memory is unmapped. False where
    ``device_type`` is not this process's accelerator or cannot (only CUDA and ROCm can here) and where the
    accelerator refused, then with one DEBUG line: never an error. Local."""
    if device_type not in _HOST_REGISTERS or not pinned_staging(device_type):
        return False
    try:
        error = int(_cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE))
    except RuntimeError as err:
        logger.debug("could not page-lock %d bytes of host memory for %s copies (%s)", nbytes, device_type, err)
        return False
    if error:
        _clear_error(device_type)
        logger.debug(
            "could not page-lock %d bytes of host memory for %s copies (cudaHostRegister: error %d)",
            nbytes,
            device_type,
            error,
        )
        return False
    return True


def unregister_host(address: int, device_type: str) -> None:
    """Undo :func:`register_host` of the memory at ``address``; a refusal is one DEBUG line, never an error. Local."""
    if device_type not in _HOST_REGISTERS:
        return
    try:
        error = int(_cudart().cudaHostUnregister(address))
    except RuntimeError as err:
        logger.debug("could not unlock host memory registered for %s copies (%s)", device_type, err)
        return
    if error:
        _clear_error(device_type)
        logger.debug(
            "could not unlock host memory registered for %s copies (cudaHostUnregister: error %d)", device_type, error
        )


def _cudart() -> Any:
    """torch's bindings of the CUDA (or HIP) runtime."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _clear_error(device_type: str) -> None:
    # A failed runtime call stays this thread's last CUDA error, which torch raises at its next kernel launch
    # (C10_CUDA_KERNEL_LAUNCH_CHECK reads cudaGetLastError, which torch does not bind for Python): a kernel launched
    # here reads it, and raises it here instead.
    with contextlib.suppress(RuntimeError):
        torch.ones(1, device=current_device(device_type))


def _rng_module(device: torch.device, function: str) -> ModuleType | None:
    """``device``'s module when it is this process's accelerator and that module has ``function``."""
    acc = current_accelerator()
    if acc is None or acc.type != device.type:
        return None
    module: ModuleType = torch.get_device_module(device.type)
    return module if callable(getattr(module, function, None)) else None


def device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The RNG state of ``device`` alone (never every visible device's), or None where it has none to give."""
    module = _rng_module(device, "get_rng_state")
    if module is None:
        return None
    state: torch.Tensor = module.get_rng_state(device)
    return state


def set_device_rng_state(state: torch.Tensor, device: torch.device) -> bool:
    """Restore ``device``'s RNG state; False (nothing changed) when ``device`` cannot take one here."""
    module = _rng_module(device, "set_rng_state")
    if module is None:
        return False
    module.set_rng_state(state.to("cpu", torch.uint8), device)
    return True


def seed_device(seed: int, device: torch.device) -> bool:
    """Seed ``device``'s generator only (not every visible device's); False when ``device`` has none here."""
    module = _rng_module(device, "manual_seed")
    if module is None:
        return False
    with torch.accelerator.device_index(device.index):
        module.manual_seed(seed)
    return True
