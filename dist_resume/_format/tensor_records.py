"""The records of a torch zip checkpoint, in torch's order, where each distinct tensor is one contiguous record.

One owner for which records a torch zip holds and in which order: ``data.pkl`` and the small fixed records
(:func:`head_records`), one record per storage, then ``version`` and ``.data/serialization_id``
(:func:`foot_records`), the records torch 2.13 writes. :func:`plan_records` plans the archive in which every tensor
object is one contiguous CPU record of its own (walk order, a tensor reachable twice once): ``data.pkl`` pickled with
meta stand-ins (shape and dtype are all it needs), the record sizes, and the :class:`RecordSpec` list from which
:func:`~dist_resume._format.zip_layout.plan_layout` places every record (64-aligned: the offsets torch's writer and
:class:`~dist_resume._format.zip_write.ZipWriter` give them). :func:`~dist_resume._format.stream_write.write_streamed`
writes that archive record by record; the memory tier lays it out whole and copies each tensor into its place.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from .._core.torch_compat.private import storage_class_for
from .._core.tree import map_tensors
from .archive import ArchiveContents, StorageInfo
from .pickle_write import dump_pickle
from .zip_layout import RecordSpec

__all__ = ["ARCHIVE_NAME", "TensorRecords", "distinct_tensors", "head_records", "foot_records", "plan_records"]

ARCHIVE_NAME: Final = "archive"


def distinct_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` in the order their records are written: walk order, each tensor object once (a tensor
    reachable twice, e.g. tied weights, is one record). Local."""
    seen: dict[int, torch.Tensor] = {}
    map_tensors(obj, lambda t: seen.setdefault(id(t), t))
    return list(seen.values())


def head_records(pickled: bytes) -> list[tuple[str, bytes]]:
    """The records before the storages, as torch writes them: the pickle, then the small fixed ones. Local."""
    return [
        (f"{ARCHIVE_NAME}/data.pkl", pickled),
        (f"{ARCHIVE_NAME}/.format_version", b"1"),
        (f"{ARCHIVE_NAME}/.storage_alignment", b"64"),
        (f"{ARCHIVE_NAME}/byteorder", b"little"),
    ]


def foot_records() -> list[tuple[str, bytes]]:
    """The records after the storages: the version and a new random serialization id. Local."""
    return [
        (f"{ARCHIVE_NAME}/version", b"3\n"),
        (f"{ARCHIVE_NAME}/.data/serialization_id", str(secrets.randbits(128)).zfill(40).encode()),
    ]


@dataclass(frozen=True, slots=True)
class TensorRecords:
    """An archive planned with every tensor one contiguous record: ``data/<i>`` holds ``tensors[i]``'s
    ``sizes[i]`` bytes, between the ``head`` and ``foot`` records (name, bytes)."""

    tensors: tuple[torch.Tensor, ...]
    sizes: tuple[int, ...]
    head: tuple[tuple[str, bytes], ...]
    foot: tuple[tuple[str, bytes], ...]

    @staticmethod
    def name(i: int) -> str:
        """The record name of the ``i``-th tensor."""
        return f"{ARCHIVE_NAME}/data/{i}"

    @property
    def first_tensor(self) -> int:
        """The position of ``data/0`` among the records."""
        return len(self.head)

    def small(self) -> dict[int, bytes]:
        """Every record but the tensors' by its position: their bytes. Local."""
        after = self.first_tensor + len(self.tensors)
        return {i: data for i, (_, data) in enumerate(self.head)} | {
            after + i: data for i, (_, data) in enumerate(self.foot)
        }

    def specs(self) -> list[RecordSpec]:
        """Every record, in order, for :func:`~dist_resume._format.zip_layout.plan_layout`. Local."""
        return [
            *(RecordSpec(name, len(data)) for name, data in self.head),
            *(RecordSpec(self.name(i), n) for i, n in enumerate(self.sizes)),
            *(RecordSpec(name, len(data)) for name, data in self.foot),
        ]


def plan_records(obj: Any) -> TensorRecords:
    """Plan ``obj``'s archive with every tensor one contiguous CPU record (see the module's docstring). Local; reads no
    tensor byte. ``obj``'s tensors may be of any kind whose ``shape`` and ``dtype`` are the full value's (a DTensor
    too); views are saved as their values, ``requires_grad`` is not kept.

    Example::

        >>> plan = plan_records({"w": torch.ones(2, 3), "step": 7})
        >>> plan.sizes, [r.name for r in plan.specs()][4]
        ((24,), 'archive/data/0')
    """
    tensors = distinct_tensors(obj)
    contents = ArchiveContents(Path(), ARCHIVE_NAME, [], 0, None, {})
    stand_ins: dict[int, torch.Tensor] = {}
    sizes = []
    for i, tensor in enumerate(tensors):
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        cls, storage_dtype = storage_class_for(tensor.dtype)
        nbytes = math.prod(tensor.shape) * tensor.dtype.itemsize
        numel = nbytes // storage_dtype.itemsize
        key = str(i)
        contents.register(
            meta.untyped_storage(),
            StorageInfo(key, storage_dtype, "cpu", numel, nbytes, ("storage", cls, key, "cpu", numel)),
        )
        stand_ins[id(tensor)] = meta
        sizes.append(nbytes)
    pickled = dump_pickle(map_tensors(obj, lambda t: stand_ins[id(t)]), contents)
    return TensorRecords(tuple(tensors), tuple(sizes), tuple(head_records(pickled)), tuple(foot_records()))
