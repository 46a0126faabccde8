"""The records of one torch zip checkpoint, planned before any byte is written: what a striped save fills in.

:func:`plan_archive` turns a payload into everything but its tensor bytes: ``data.pkl`` (pickled with meta stand-ins,
:func:`~dist_resume._format.pickle_write.dump_pickle`), the small fixed records, one record per distinct storage in the
order ``torch.save`` names them (walk order, a storage shared by several tensors once, its whole bytes, views kept as
views: the same names and bytes as ``torch.save`` of the same payload), and their places in the file
(:func:`~dist_resume._format.zip_layout.plan_layout`). A storage of at least ``threshold`` bytes gets its data on an
``alignment`` boundary (1 MiB) so that each can be written by another process; smaller ones stay 64-aligned as
torch writes them. Each storage is found again through :attr:`StorageRecord.path`, its first tensor's place in the
payload, so another process holding the same structure can find its own copy of it (:func:`find_tensor`).
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from .._core.torch_compat.private import storage_class_for, storage_id
from .._core.tree import map_tensors
from .archive import ArchiveContents, StorageInfo
from .pickle_write import dump_pickle
from .tensor_records import ARCHIVE_NAME, foot_records, head_records
from .zip_layout import RecordSpec, ZipLayout, plan_layout
from .zip_write import data_descriptor

__all__ = [
    "STRIPE_ALIGNMENT",
    "STRIPE_THRESHOLD",
    "TreePath",
    "StorageRecord",
    "ArchivePlan",
    "tensor_paths",
    "find_tensor",
    "cpu_storage",
    "storage_bytes",
    "plan_archive",
]

STRIPE_ALIGNMENT: Final = 1 << 20
"""Where a striped record's data starts: a multiple of 1 MiB (of 64 too, so ``.storage_alignment`` stays ``64``)."""
STRIPE_THRESHOLD: Final = 1 << 20
"""Storages smaller than this stay 64-aligned and are written with the pickle by the rank that writes it: spreading
them would cost a page and an alignment gap each for a write that takes microseconds."""

TreePath = tuple[Any, ...]
"""Keys and indices from the payload's root to a tensor: ``("optimizer", "state", 3, "exp_avg")``."""


@dataclass(frozen=True, slots=True)
class StorageRecord:
    """One storage record ``archive/data/<index>``: the first tensor viewing it, and the record's place."""

    index: int
    path: TreePath
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    nbytes: int  # the whole storage's: the record's size
    header_offset: int
    data_offset: int
    large: bool  # at least STRIPE_THRESHOLD bytes: aligned on STRIPE_ALIGNMENT, writable by any rank

    def descriptor(self, crc: int) -> bytes:
        """The record's data descriptor, written right after its data by whoever writes the data. Local."""
        return data_descriptor(crc=crc, size=self.nbytes, compress_size=self.nbytes, header=self.header_offset)

    def describes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (another process's copy) has this record's dtype, shape, view and storage size."""
        return (
            tensor.dtype == self.dtype
            and tuple(tensor.shape) == self.shape
            and tuple(tensor.stride()) == self.stride
            and tensor.storage_offset() == self.storage_offset
            and tensor.untyped_storage().nbytes() == self.nbytes
        )


@dataclass(frozen=True, slots=True)
class ArchivePlan:
    """Everything of an archive but its storages' bytes: the small records' bytes, the storages, the layout."""

    small: dict[int, bytes]  # record position in layout.records -> its bytes (data.pkl and the fixed records)
    storages: tuple[StorageRecord, ...]
    layout: ZipLayout
    first_storage: int  # the position of archive/data/0 in layout.records

    def position(self, record: StorageRecord) -> int:
        """The record's position in :attr:`layout`'s records (and in the CRC list the tail needs)."""
        return self.first_storage + record.index


def tensor_paths(obj: Any, path: TreePath = ()) -> Iterator[tuple[TreePath, torch.Tensor]]:
    """Every tensor of ``obj`` with its path, in the order ``torch.save`` pickles them (dicts, lists and tuples, as
    :func:`~dist_resume._core.tree.map_tensors` walks). Local."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from tensor_paths(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from tensor_paths(value, (*path, i))


def find_tensor(obj: Any, path: TreePath) -> torch.Tensor | None:
    """The tensor at ``path`` in ``obj``, or None where the structure has none there. Local; never raises."""
    node = obj
    for key in path:
        try:
            if isinstance(node, dict):
                node = node[key]
            elif isinstance(node, (list, tuple)) and type(key) is int:
                node = node[key]
            else:
                return None
        except (KeyError, IndexError, TypeError):
            return None
    return node if isinstance(node, torch.Tensor) else None


def cpu_storage(tensor: torch.Tensor) -> torch.UntypedStorage:
    """``tensor``'s whole storage on the CPU (itself, or a copy of one elsewhere): what ``torch.save`` writes. Local."""
    storage = tensor.untyped_storage()
    return storage if storage.device.type == "cpu" else storage.cpu()  # type: ignore[no-untyped-call]


def storage_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU storage, without a copy; valid while the caller holds ``storage``. Local."""
    nbytes = storage.nbytes()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(storage.data_ptr())).cast("B")


def _stand_in(tensor: torch.Tensor, storage: torch.UntypedStorage) -> torch.Tensor:
    meta = torch.empty(0, dtype=tensor.dtype, device="meta")
    return meta.set_(storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride())  # type: ignore[call-overload]


def plan_archive(payload: Any, *, threshold: int = STRIPE_THRESHOLD, alignment: int = STRIPE_ALIGNMENT) -> ArchivePlan:
    """Plan ``payload``'s archive (see the module's docstring). Local; reads no tensor byte.

    Example::

        >>> plan = plan_archive({"w": torch.zeros(1 << 19), "step": 3})
        >>> [(r.index, r.path, r.large, r.data_offset % (1 << 20)) for r in plan.storages]
        [(0, ('w',), True, 0)]
    """
    contents = ArchiveContents(Path(), ARCHIVE_NAME, [], 0, None, {})
    metas: dict[int, torch.UntypedStorage] = {}
    found: list[tuple[TreePath, torch.Tensor]] = []
    stand_ins: dict[int, torch.Tensor] = {}
    for path, tensor in tensor_paths(payload):
        storage = tensor.untyped_storage()
        sid = storage_id(storage)
        if sid not in metas:
            meta = torch.UntypedStorage(storage.nbytes(), device="meta")  # type: ignore[no-untyped-call]
            cls, storage_dtype = storage_class_for(tensor.dtype)
            key, nbytes = str(len(metas)), storage.nbytes()
            numel = nbytes // storage_dtype.itemsize
            tag = torch.serialization.location_tag(storage)
            contents.register(
                meta, StorageInfo(key, storage_dtype, tag, numel, nbytes, ("storage", cls, key, tag, numel))
            )
            metas[sid] = meta
            found.append((path, tensor))
        stand_ins[id(tensor)] = _stand_in(tensor, metas[sid])
    pickled = dump_pickle(map_tensors(payload, lambda t: stand_ins[id(t)]), contents)
    head, foot = head_records(pickled), foot_records()
    specs = [RecordSpec(name, len(data)) for name, data in head]
    sizes = [t.untyped_storage().nbytes() for _, t in found]
    specs += [
        RecordSpec(f"{ARCHIVE_NAME}/data/{i}", n, alignment if n >= threshold else 64) for i, n in enumerate(sizes)
    ]
    specs += [RecordSpec(name, len(data)) for name, data in foot]
    layout = plan_layout(specs)
    first = len(head)
    small = {i: data for i, (_, data) in enumerate(head)}
    small.update({first + len(found) + i: data for i, (_, data) in enumerate(foot)})
    storages = tuple(
        StorageRecord(
            i,
            path,
            t.dtype,
            tuple(t.shape),
            tuple(t.stride()),
            int(t.storage_offset()),
            n,
            layout.records[first + i].header_offset,
            layout.records[first + i].data_offset,
            n >= threshold,
        )
        for i, ((path, t), n) in enumerate(zip(found, sizes))
    )
    return ArchivePlan(small, storages, layout, first)
