"""Reading a :class:`~dist_resume._source.source.Source`: on this rank, or on rank 0 and broadcast to every rank.

Both yield a :class:`SourceContents`: a torch file's object (split into parts later, with the live model's keys),
or a foreign source's :class:`CheckpointParts` (split already by the reader that knows its files).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol, TypeVar

import torch
import torch.distributed as dist

from .._core.log import log_rank0
from .._core.text import preview
from .._core.tree import iter_tensors
from .._core.types import MapLocation
from .._dist.broadcast import DEFAULT_BUCKET_BYTES, broadcast_loaded
from .._foreign.folders import read_foreign_folder
from .._foreign.safetensors_read import read_safetensors
from .._format.load import load_torch_file
from .._layout.layout import CheckpointParts, Layout
from .integrity import verify_source
from .source import Source

__all__ = ["SourceContents", "ReceivingPlan", "read_source", "read_broadcast", "parts_to_fields", "parts_from_fields"]

_MORE: Final = (("more_models", "model"), ("more_optimizers", "optimizer"), ("more_schedulers", "scheduler"))


@dataclass(frozen=True)
class SourceContents:
    """A :class:`Source` as read: ``obj`` (a torch file's object) or ``parts`` (a foreign source, split already);
    whether its tensors map the file (what is kept must be copied out), and whether it is collective (every rank
    holds rank 0's contents, so the ranks must agree on its validation before any of them changes anything)."""

    source: Source
    obj: Any = None
    parts: CheckpointParts | None = None
    mmapped: bool = False
    collective: bool = False

    @property
    def path(self) -> Path:
        return self.source.path


def read_source(
    source: Source,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
) -> SourceContents:
    """Read ``source`` on this rank. Local.

    A torch file goes through :func:`~dist_resume._format.load.load_torch_file` (``map_location`` None: this
    rank's device); a ``.safetensors`` file and a foreign folder through their readers (``map_location`` None:
    the CPU). ``verify=True`` first checks every torch file's CRC-32s and every safetensors header.
    """
    p = source.path
    if source.layout is None:
        obj = load_torch_file(p, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
        return SourceContents(source, obj=obj, mmapped=mmap)
    if verify:
        verify_source(p)
    if source.layout is Layout.SAFETENSORS:
        weights, metadata = read_safetensors(p, map_location="cpu" if map_location is None else map_location, mmap=mmap)
        meta = {"source_layout": source.layout.value, "files": [p.name], "safetensors_metadata": metadata}
        parts = CheckpointParts(Layout.SAFETENSORS, weights, meta=meta, keys={"model": p.name})
        return SourceContents(source, parts=parts, mmapped=mmap)
    parts = read_foreign_folder(p, source.layout, map_location=map_location, mmap=mmap, weights_only=weights_only)
    for key, what in _MORE:
        more = parts.meta.get(key)
        if more:
            log_rank0(logging.INFO, "%s holds more than one %s: the first is read, not %s", p, what, preview(more, 4))
    return SourceContents(source, parts=parts, mmapped=mmap)


class ReceivingPlan(Protocol):
    """What :func:`read_broadcast`'s ``prepare`` builds before the data moves (a validated restore plan)."""

    def destinations(self) -> dict[int, torch.Tensor]:
        """``{id(tensor prepare saw): existing tensor}`` for data that may land straight in place."""
        ...

    def rebind(self: P, arrived: Mapping[int, torch.Tensor]) -> P:
        """The same, pointing at ``arrived[id(tensor prepare saw)]``: the tensors holding the data now."""
        ...


P = TypeVar("P", bound=ReceivingPlan)


def parts_to_fields(parts: CheckpointParts) -> dict[str, Any]:
    """``parts`` as a plain dict (the layout by its value) to send through an object broadcast."""
    fields = {f.name: getattr(parts, f.name) for f in dataclasses.fields(parts)}
    fields["layout"] = parts.layout.value
    return fields


def parts_from_fields(fields: dict[str, Any]) -> CheckpointParts:
    """The :class:`CheckpointParts` :func:`parts_to_fields` sent; its tensors are the very objects in ``fields``."""
    return CheckpointParts(**{**fields, "layout": Layout(fields["layout"])})


def read_broadcast(
    source: Source,
    *,
    mmap: bool,
    weights_only: bool,
    verify: bool,
    prepare: Callable[[SourceContents], P],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[SourceContents, P]:
    """Global rank 0 reads ``source`` (decided already, the same on every rank); all ranks get its contents.

    Collective. Only rank 0 touches the filesystem, so the other ranks need not see the file.
    ``prepare`` runs once on every rank after the structure has arrived and before any tensor data
    moves: on rank 0's real object (rank 0) or on stand-ins whose tensors are on the meta device (the
    others). It may validate, collectively. On the other ranks the data then lands in its result's
    :meth:`~ReceivingPlan.destinations` (fresh CPU tensors elsewhere). Returns what was read and
    ``prepare``'s result rebound to the tensors holding the data.
    """
    rank0 = dist.get_rank() == 0
    view: tuple[Any, Any] | None = None  # rank 0: (a torch file's object, a foreign source's parts as fields)
    failure: Exception | None = None
    if rank0:  # read before the collective, so that it is not a callback from _dist into this layer
        try:
            read = read_source(source, map_location="cpu", mmap=mmap, weights_only=weights_only, verify=verify)
            view = (read.obj, None if read.parts is None else parts_to_fields(read.parts))
        except Exception as err:  # every rank raises it, from broadcast_loaded
            failure = err

    def load() -> tuple[Any, Any]:
        if failure is not None:
            raise failure
        assert view is not None  # rank 0 read it or failed; the others never call load
        return view

    mmapped = mmap and rank0  # the others receive into memory of their own
    seen: list[tuple[Any, P]] = []  # (the object prepare saw, its result): broadcast_loaded keeps no result

    def as_contents(arrived: tuple[Any, Any]) -> SourceContents:
        parts = None if arrived[1] is None else parts_from_fields(arrived[1])
        return SourceContents(source, obj=arrived[0], parts=parts, mmapped=mmapped, collective=True)

    def prepare_view(arrived: tuple[Any, Any]) -> dict[int, torch.Tensor]:
        prepared = prepare(as_contents(arrived))
        seen.append((arrived, prepared))
        return prepared.destinations() if not rank0 else {}

    arrived_view = broadcast_loaded(load, bucket_bytes=bucket_bytes, prepare=prepare_view)
    ((prepared_view, prepared),) = seen
    # both objects are rank 0's structure, one holding what prepare saw, the other the data: pair them in order
    pairs = zip(iter_tensors(prepared_view), iter_tensors(arrived_view), strict=True)
    return as_contents(arrived_view), prepared.rebind({id(old): new for old, new in pairs})
