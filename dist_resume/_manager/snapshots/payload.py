"""A snapshot's payload laid out as the torch file it becomes, and its tensors copied into their places.

The payload is planned as the file :func:`~dist_resume._format.stream_write.write_streamed` writes (every tensor one
contiguous CPU record in pickle order, the archive :func:`~dist_resume._format.tensor_records.plan_records` plans), its
records placed by :func:`~dist_resume._format.zip_layout.plan_layout` and turned into a
:class:`~dist_resume._shm.FileLayout` (the headers, ``data.pkl`` and the zip's tail written as they are, each
tensor's record a region). The plan is one pass: the payload itself is pickled, each tensor reduced on its first
encounter to its record's stand-in (the reduction :func:`~dist_resume._format.pickle_write.dump_pickle` gives a meta
tensor of its shape and dtype), which is how its records are found and numbered; the stand-ins are kept from one
snapshot to the next (a snapshot of the same structure makes none), as are the records' places when their sizes are
the same (``data.pkl`` and the serialization id are then regions whose bytes and CRC-32s each snapshot brings), and
the tensors' paths are walked only when the node's other ranks copy a share (:mod:`.split`). :func:`copy_records` is the snapshot's one pass over the data: each
tensor copied with ``copy_`` into a view of the slot's mapping at its record, whichever local rank copies it; from the
accelerator through page-locked memory where it has some (the mapping registered, or pinned staging buffers:
:mod:`.pinned`).
"""

from __future__ import annotations

import io
import math
import mmap
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..._core.torch_compat.private import storage_class_for, tensor_reduction
from ..._format.striped_archive import STRIPE_THRESHOLD, TreePath, tensor_paths
from ..._format.tensor_records import TensorRecords, foot_records, head_records
from ..._format.zip_layout import plan_layout
from ..._shm import FileLayout, zip_file_layout
from .pinned import copying_into

__all__ = ["CopyRecord", "LaidOut", "Pickled", "pickled", "laid_out", "copyable", "record_view", "copy_records"]


@dataclass(frozen=True, slots=True)
class CopyRecord:
    """A tensor's record in a snapshot's file: where its ``nbytes`` go (``offset``), and its first path in the payload
    (``()`` where the walk of :func:`~dist_resume._format.striped_archive.tensor_paths` does not reach it, it is
    reached more than once, or no path was asked for); ``large`` ones may be copied by another local rank."""

    index: int
    path: TreePath
    nbytes: int
    large: bool
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Pickled:
    """A payload pickled as its snapshot's ``data.pkl`` (``data``), and its tensors in record order."""

    data: bytes
    tensors: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class LaidOut:
    """The file's layout, each tensor's record (by its index), the tensors themselves in the same order, and the
    ``data.pkl`` written into it."""

    layout: FileLayout
    records: tuple[CopyRecord, ...]
    tensors: tuple[torch.Tensor, ...]
    pickled: bytes


def copyable(tensor: torch.Tensor) -> bool:
    """Whether the copy takes ``tensor`` as torch.save would: a plain strided tensor with its data. Local."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
    )


class _NotCopyable(Exception):
    """Raised inside the pickling of a payload with a tensor the copy cannot take."""


class _StorageRef:
    """Pickled as the persistent id of record ``data/<key>``."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


_reductions: list[tuple[tuple[int, ...], torch.dtype, tuple[Any, Any]]] = []
"""The stand-in reduction of record ``i`` (its shape and dtype, the reduction), kept across snapshots."""


def _reduction(i: int, tensor: torch.Tensor) -> tuple[Any, Any]:
    """The reduction of record ``i``'s stand-in for ``tensor``: made once per (position, shape, dtype)."""
    shape = tuple(tensor.shape)
    if i < len(_reductions):
        known = _reductions[i]
        if known[0] == shape and known[1] is tensor.dtype:
            return known[2]
    cls, storage_dtype = storage_class_for(tensor.dtype)
    numel = math.prod(shape) * tensor.dtype.itemsize // storage_dtype.itemsize
    meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
    reduction = tensor_reduction(meta, _StorageRef(("storage", cls, str(i), "cpu", numel)), storage_dtype)
    entry = (shape, tensor.dtype, reduction)
    if i < len(_reductions):
        _reductions[i] = entry
    elif i == len(_reductions):
        _reductions.append(entry)
    return reduction


class _PayloadPickler(pickle.Pickler):
    """Pickles a payload as ``torch.save`` pickles the archive of :func:`plan_records`: each tensor, at its first
    encounter, numbered and reduced to its record's stand-in (a tensor met again is the pickle's memo)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=2)  # torch.save's default protocol
        self.tensors: list[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageRef else None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        if not copyable(obj):
            raise _NotCopyable
        self.tensors.append(obj)
        return _reduction(len(self.tensors) - 1, obj)


def pickled(payload: Any) -> Pickled | None:
    """``payload`` pickled as its snapshot's ``data.pkl`` (see the module's docstring), or None when a tensor cannot be
    copied raw (a subclass, a sparse or meta tensor). Local; reads no tensor byte.

    Example::

        >>> [tuple(t.shape) for t in pickled({"w": torch.ones(2, 3), "step": 7}).tensors]
        [(2, 3)]
    """
    buffer = io.BytesIO()
    pickler = _PayloadPickler(buffer)
    try:
        pickler.dump(payload)
    except _NotCopyable:
        return None
    return Pickled(buffer.getvalue(), tuple(pickler.tensors))


@dataclass(frozen=True)
class _Placed:
    """What a file's layout owes to its records' sizes alone (``key``), kept for the next snapshot of the same
    structure: the layout with ``data.pkl`` and the serialization id as regions (their bytes come with each snapshot,
    at ``small_at``, their CRC-32s at the seal), and each tensor record's data offset."""

    key: tuple[int, ...]
    layout: FileLayout
    small_at: tuple[int, int]
    offsets: tuple[int, ...]


_placed: _Placed | None = None


def _placement(records: TensorRecords) -> _Placed:
    """The records' places: planned, or the last snapshot's when its records had the same sizes."""
    global _placed
    pickle_size, id_size = len(records.head[0][1]), len(records.foot[-1][1])
    key = (pickle_size, id_size, *records.sizes)
    placed = _placed
    if placed is not None and placed.key == key:
        return placed
    zip_layout = plan_layout(records.specs())
    last = records.first_tensor + len(records.tensors) + len(records.foot) - 1  # the serialization id
    small = {i: data for i, data in records.small().items() if i not in (0, last)}
    offsets = tuple(zip_layout.records[records.first_tensor + i].data_offset for i in range(len(records.tensors)))
    at = (zip_layout.records[0].data_offset, zip_layout.records[last].data_offset)
    placed = _placed = _Placed(key, zip_file_layout(zip_layout, small), at, offsets)
    return placed


def laid_out(payload: dict[str, Any], *, paths: bool = False) -> LaidOut | None:
    """``payload`` laid out as its torch file (see the module's docstring); None when a tensor cannot be copied raw (a
    subclass, a sparse or meta tensor). ``paths``: each record's path in the payload (for the node's other ranks,
    which find their share's tensors by it), and which records are large enough to share. Local."""
    plan = pickled(payload)
    if plan is None:
        return None
    sizes = tuple(math.prod(t.shape) * t.dtype.itemsize for t in plan.tensors)
    records = TensorRecords(plan.tensors, sizes, tuple(head_records(plan.data)), tuple(foot_records()))
    placed = _placement(records)
    found: dict[int, TreePath | None] = {}
    if paths:
        for path, tensor in tensor_paths(payload):  # a tensor reached twice has no one path
            found[id(tensor)] = path if id(tensor) not in found else None
    copies = tuple(
        CopyRecord(
            i,
            found.get(id(tensor)) or (),
            nbytes,
            nbytes >= STRIPE_THRESHOLD and bool(found.get(id(tensor))),
            placed.offsets[i],
            tensor.dtype,
            tuple(tensor.shape),
        )
        for i, (tensor, nbytes) in enumerate(zip(plan.tensors, sizes))
    )
    pickle_at, id_at = placed.small_at
    fixed = (*placed.layout.fixed, (pickle_at, plan.data), (id_at, records.foot[-1][1]))
    layout = FileLayout(placed.layout.size, fixed, placed.layout.regions)
    return LaidOut(layout, copies, plan.tensors, plan.data)


def record_view(mm: mmap.mmap, record: CopyRecord) -> torch.Tensor:
    """The bytes of ``record`` in the slot's mapping ``mm``, as a tensor of its dtype and shape (sharing the mapping:
    drop it before the mapping is closed). Local."""
    if not record.nbytes:
        return torch.empty(record.shape, dtype=record.dtype)
    raw = torch.frombuffer(mm, dtype=torch.uint8, count=record.nbytes, offset=record.offset)
    return raw.view(record.dtype).view(record.shape)


def copy_records(mm: mmap.mmap, copies: Iterable[tuple[CopyRecord, torch.Tensor]]) -> int:
    """Copy each tensor into its record in the slot's mapping ``mm`` (an accelerator's through page-locked memory
    where it has some: :func:`~.pinned.copying_into`); the bytes copied, all landed when it returns. Local."""
    dest = torch.frombuffer(mm, dtype=torch.uint8)
    copied = 0
    try:
        with torch.no_grad(), copying_into(mm, dest) as copy:
            for record, tensor in copies:
                if record.nbytes:
                    start = record.offset
                    copy(dest[start : start + record.nbytes].view(record.dtype).view(record.shape), tensor)
                    copied += record.nbytes
    finally:
        del dest  # the mapping's buffer is released with it
    return copied
