"""A snapshot's copies from the accelerator into the slot's mapping, through page-locked memory where it has some.

A copy from a device into pageable host memory is the driver's slow path (CUDA stages it through a small pinned
buffer of its own and blocks). So, as torch's DCP staging does with shared memory
(``_create_cpu_state_dict(pin_memory=True, share_memory=True)``), each tensor goes one of three ways:

1. **registered**: where the accelerator page-locks memory it did not allocate (CUDA, and ROCm, which reports as
   cuda: :func:`~dist_resume._dist.accelerator.register_host`), the slot's mapping is registered the first time this
   process copies into it, once per mapping it keeps, and unregistered just before the mapping is dropped
   (:func:`~dist_resume._shm.slots.when_unmapped`). Each tensor is copied into it with ``non_blocking=True``;
   the devices copied from are synchronized once, before :func:`copying_into` ends.
2. **staged**: where it has pinned memory but no registration (xpu, the test accelerator), or the registration was
   refused: through two pinned buffers of :data:`STAGING_BYTES` each, allocated once per process and reused. A larger
   tensor goes in chunks along its first dimension (a contiguous one seen flat), each chunk's device-to-pinned copy
   queued before the previous chunk's pinned-to-mapping copy, so that the two overlap where the backend copies
   asynchronously.
3. **direct**: a CPU tensor, an accelerator without pinned memory, a non-contiguous tensor whose rows are larger than
   a buffer: straight into the mapping, as before.

The bytes are the same each way.
"""

from __future__ import annotations

import enum
import functools
import mmap
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Final, NamedTuple

import torch

from ..._core.log import logger
from ..._dist.accelerator import pinned_staging, register_host, synchronize, unregister_host
from ..._shm.slots import when_unmapped

__all__ = ["STAGING_BYTES", "copying_into"]

STAGING_BYTES: Final = 64 << 20
"""The size of each of the two pinned staging buffers (way 2); 0: no staging."""

Copy = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(dest, src)``: ``src`` into ``dest``, a view of the mapping of the same dtype and shape."""

_registered: dict[int, int | None] = {}  # id(mapping) -> its address, registered; None: not registered
_registered_lock = threading.Lock()

# (device type, size) -> the two staging buffers, or None: refused; held by one copy at a time
_buffers: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor] | None] = {}
_buffers_lock = threading.Lock()


class _Way(enum.Enum):
    """How a device type's tensors are copied into the mapping (the module's docstring)."""

    REGISTERED = 1
    STAGED = 2
    DIRECT = 3


class _Chunk(NamedTuple):
    staged: torch.Tensor  # in a pinned buffer, its copy from ``device`` queued
    dest: torch.Tensor  # its place in the mapping
    device: torch.device
    event: torch.Event | None  # recorded after that copy; None: the device is synchronized instead


def _land(chunk: _Chunk) -> None:
    """Wait for ``chunk``'s copy into its buffer, then copy it into its place in the mapping."""
    if chunk.event is not None:
        chunk.event.synchronize()
    else:
        synchronize([chunk.device])
    chunk.dest.copy_(chunk.staged)


def _recorded(device: torch.device) -> torch.Event | None:
    """An event after the work queued on ``device``'s current stream; None where the backend has none."""
    try:
        event = torch.Event(device=device)
        event.record(torch.accelerator.current_stream(device))
    except RuntimeError:
        return None
    return event


def _registration(mm: mmap.mmap, host: torch.Tensor, device_type: str) -> bool:
    """Whether ``mm`` (``host``: its bytes) is registered for ``device_type``'s copies: asked once per mapping this
    process keeps (one that it does not keep is never registered: nothing would unregister it)."""
    key = id(mm)  # unique while registered: the mapping is kept until its callback has run
    with _registered_lock:
        if key in _registered:
            return _registered[key] is not None
    if not when_unmapped(mm, functools.partial(_unregister, key, device_type)):
        return False
    address = host.data_ptr()
    done = register_host(address, host.nbytes, device_type)
    with _registered_lock:
        _registered[key] = address if done else None
    return done


def _unregister(key: int, device_type: str) -> None:
    with _registered_lock:
        address = _registered.pop(key, None)
    if address is not None:
        unregister_host(address, device_type)


def _staging_pair(device_type: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The two pinned buffers for ``device_type``'s copies (made at the first use; the caller holds the lock)."""
    key = (device_type, STAGING_BYTES)
    if key not in _buffers:
        _buffers.clear()  # another size: the old pair is dropped
        try:
            pair = tuple(torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) for _ in range(2))
            _buffers[key] = (pair[0], pair[1])
        except RuntimeError as err:  # pinned memory exhausted: the copies go directly
            logger.debug("no pinned staging buffers for %s copies (%s): copying directly", device_type, err)
            _buffers[key] = None
    return _buffers[key]


class _Copier:
    """One :func:`copying_into`: the way each device type's tensors go, and what is still in flight."""

    def __init__(self, mm: mmap.mmap, host: torch.Tensor) -> None:
        self._mm = mm
        self._host: torch.Tensor | None = host
        self._ways: dict[str, _Way] = {}  # per device type
        self._queued: dict[torch.device, None] = {}  # devices copied from without blocking into the mapping
        self._pending: _Chunk | None = None  # the staged chunk not yet in the mapping
        self._pair: tuple[torch.Tensor, torch.Tensor] | None = None  # the staging buffers, their lock held
        self._chunks = 0

    def _way(self, device_type: str) -> _Way:
        way = self._ways.get(device_type)
        if way is None:
            if device_type == "cpu" or not pinned_staging(device_type):
                way = _Way.DIRECT
            elif self._host is not None and _registration(self._mm, self._host, device_type):
                way = _Way.REGISTERED
            elif STAGING_BYTES > 0 and self._hold(device_type):
                way = _Way.STAGED
            else:
                way = _Way.DIRECT
            self._ways[device_type] = way
        return way

    def _hold(self, device_type: str) -> bool:
        if self._pair is None:
            _buffers_lock.acquire()
            self._pair = _staging_pair(device_type)
            if self._pair is None:
                _buffers_lock.release()
        return self._pair is not None

    def copy(self, dest: torch.Tensor, src: torch.Tensor) -> None:
        way = self._way(src.device.type)
        if way is _Way.REGISTERED:
            dest.copy_(src, non_blocking=True)
            self._queued[src.device] = None
        elif way is not _Way.STAGED or self._pair is None or not self._stage(dest, src, self._pair):
            dest.copy_(src)

    def _stage(self, dest: torch.Tensor, src: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor]) -> bool:
        """``src`` into ``dest`` through the staging buffers ``pair``, in chunks of whole rows; False (nothing
        copied) when one row is larger than a buffer."""
        if src.is_contiguous():
            src, dest = src.reshape(-1), dest.reshape(-1)
        row = src.numel() // src.shape[0] * src.element_size() if src.numel() else 0
        if not 0 < row <= STAGING_BYTES:
            return False
        rows = STAGING_BYTES // row
        for start in range(0, src.shape[0], rows):
            part = src[start : start + rows]
            buffer = pair[self._chunks % 2]
            self._chunks += 1
            staged = buffer[: part.numel() * part.element_size()].view(part.dtype).view(part.shape)
            staged.copy_(part, non_blocking=True)
            chunk = _Chunk(staged, dest[start : start + rows], src.device, _recorded(src.device))
            previous, self._pending = self._pending, chunk
            if previous is not None:
                _land(previous)  # from the other buffer, while this chunk copies
        return True

    def finish(self) -> None:
        """Every copy landed: the last staged chunk, and the devices copied from without blocking synchronized."""
        chunk, self._pending = self._pending, None
        if chunk is not None:
            _land(chunk)
        queued, self._queued = list(self._queued), {}
        if queued:
            synchronize(queued)

    def release(self) -> None:
        """After :meth:`finish`, or an error: nothing queued still copies into the mapping or a buffer; the buffers and
        the mapping let go."""
        try:
            chunk, self._pending = self._pending, None
            in_flight = [*self._queued, *([chunk.device] if chunk is not None else [])]
            if in_flight:
                synchronize(in_flight)
        finally:
            self._queued, self._host = {}, None
            if self._pair is not None:
                self._pair = None
                _buffers_lock.release()


@contextmanager
def copying_into(mm: mmap.mmap, host: torch.Tensor) -> Iterator[Copy]:
    """A ``copy(dest, src)`` for copies into the slot's mapping ``mm`` (``host``: its bytes as a uint8 tensor, ``dest``
    a view of it), each tensor the way the module's docstring says; when the block ends every byte copied has landed
    (a commit reads them next). Local."""
    copier = _Copier(mm, host)
    try:
        yield copier.copy
        copier.finish()
    finally:
        copier.release()
