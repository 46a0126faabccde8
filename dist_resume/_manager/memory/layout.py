"""A snapshot's payload laid out as the torch file it becomes, and its tensors copied into their places.

The payload is planned as the file :func:`~dist_resume._format.stream_write.write_streamed` writes (every tensor one
contiguous CPU record in walk order, :func:`~dist_resume._format.tensor_records.plan_records`), its records placed by
:func:`~dist_resume._format.zip_layout.plan_layout` and turned into a
:class:`~dist_resume._memory.FileLayout` (the headers, ``data.pkl`` and the zip's tail written as they are, each
tensor's record a region). :func:`copy_records` is the snapshot's one pass over the data: each tensor copied with
``copy_`` into a view of the slot's mapping at its record, whichever local rank copies it; from the accelerator
through page-locked memory where it has some (the mapping registered, or pinned staging buffers: :mod:`.pinned`).
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..._core.tree import iter_tensors
from ..._format.striped_archive import STRIPE_THRESHOLD, TreePath, tensor_paths
from ..._format.tensor_records import plan_records
from ..._format.zip_layout import plan_layout
from ..._memory import FileLayout, zip_file_layout
from .pinned import copying_into

__all__ = ["CopyRecord", "LaidOut", "laid_out", "copyable", "copy_records"]


@dataclass(frozen=True, slots=True)
class CopyRecord:
    """A tensor's record in a snapshot's file: where its ``nbytes`` go (``offset``), and its first path in the payload
    (``()`` where the walk of :func:`~dist_resume._format.striped_archive.tensor_paths` does not reach it, or it is
    reached more than once); ``large`` ones may be copied by another local rank."""

    index: int
    path: TreePath
    nbytes: int
    large: bool
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class LaidOut:
    """The file's layout, each tensor's record (by its index) and the tensors themselves, in the same order."""

    layout: FileLayout
    records: tuple[CopyRecord, ...]
    tensors: tuple[torch.Tensor, ...]


def copyable(tensor: torch.Tensor) -> bool:
    """Whether the copy takes ``tensor`` as torch.save would: a plain strided tensor with its data. Local."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
    )


def laid_out(payload: dict[str, Any]) -> LaidOut | None:
    """``payload`` laid out as its torch file (see the module's docstring); None when a tensor cannot be copied raw (a
    subclass, a sparse or meta tensor, one inside a container the walker does not enter). Local."""
    plan = plan_records(payload)
    found = {id(t) for t in plan.tensors}
    if not all(map(copyable, plan.tensors)) or any(id(t) not in found for t in iter_tensors(payload)):
        return None
    zip_layout = plan_layout(plan.specs())
    paths: dict[int, TreePath | None] = {}
    for path, tensor in tensor_paths(payload):  # a tensor reached twice has no one path
        paths[id(tensor)] = path if id(tensor) not in paths else None
    records = tuple(
        CopyRecord(
            i,
            paths.get(id(tensor)) or (),
            nbytes,
            nbytes >= STRIPE_THRESHOLD and bool(paths.get(id(tensor))),
            zip_layout.records[plan.first_tensor + i].data_offset,
            tensor.dtype,
            tuple(tensor.shape),
        )
        for i, (tensor, nbytes) in enumerate(zip(plan.tensors, plan.sizes))
    )
    return LaidOut(zip_file_layout(zip_layout, plan.small()), records, plan.tensors)


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
