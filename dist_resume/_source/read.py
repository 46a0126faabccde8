"""Where resume's checkpoint comes from: a file, a folder's agreed newest file, or rank 0's file broadcast.

Each reader yields a :class:`Loaded`; ``resume`` plans and applies the restore the same way for all three.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from .._core.errors import CheckpointNotFoundError
from .._core.tree import iter_tensors
from .._core.types import MapLocation, PathLike
from .._dist.broadcast import DEFAULT_BUCKET_BYTES, broadcast_loaded
from .._layout.layout import CheckpointParts
from .consensus import resolve_checkpoint
from .listing import latest_checkpoint
from .open import is_foreign_source, open_checkpoint, parts_from_fields, parts_to_fields

__all__ = ["Loaded", "Prepared", "read_file", "read_folder", "read_broadcast"]


@dataclass(frozen=True)
class Loaded:
    """A checkpoint as read: its file, the loaded object, whether its tensors map the file (what is kept must
    be copied out), and whether it is collective (every rank holds rank 0's object, so the ranks must agree
    on its validation before any of them changes anything)."""

    path: Path
    obj: Any
    mmapped: bool
    collective: bool
    parts: CheckpointParts | None = None  # a foreign source (HF, Accelerate, DCP, safetensors): split already


def read_file(path: PathLike, *, map_location: MapLocation, mmap: bool, weights_only: bool, verify: bool) -> Loaded:
    """Load the checkpoint file at ``path`` (onto the CPU unless ``map_location`` says otherwise). Local."""
    opened = open_checkpoint(
        path,
        map_location="cpu" if map_location is None else map_location,
        mmap=mmap,
        weights_only=weights_only,
        verify=verify,
    )
    return Loaded(Path(path), opened.obj, mmapped=mmap, collective=False, parts=opened.parts)


def read_folder(folder: PathLike, *, map_location: MapLocation, mmap: bool, weights_only: bool, verify: bool) -> Loaded:
    """Load a checkpoint folder's newest complete checkpoint, chosen by rank 0 and confirmed by every rank.

    Collective under torch.distributed (see :func:`resolve_checkpoint`); each rank then loads its own copy.
    """
    chosen = folder if is_foreign_source(folder) else resolve_checkpoint(folder)
    return read_file(chosen, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)


class Prepared(Protocol):
    """What :func:`read_broadcast`'s ``prepare`` builds before the data moves (e.g. a validated restore plan)."""

    def destinations(self) -> dict[int, torch.Tensor]:
        """``{id(tensor prepare saw): existing tensor}`` for data that may land straight in place."""
        ...

    def rebind(self: P, arrived: Mapping[int, torch.Tensor]) -> P:
        """The same, pointing at ``arrived[id(tensor prepare saw)]``: the tensors holding the data now."""
        ...


P = TypeVar("P", bound=Prepared)


def read_broadcast(
    path: PathLike,
    *,
    mmap: bool,
    weights_only: bool,
    verify: bool,
    prepare: Callable[[Loaded], P],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[Loaded, P]:
    """Global rank 0 picks and reads the checkpoint (a file, or a folder's newest valid one); all ranks get it.

    Collective. Only rank 0 touches the filesystem, so the other ranks need not see the file.
    ``prepare`` runs once on every rank after the structure has arrived and before any tensor data
    moves: on rank 0's real object (rank 0) or on stand-ins whose tensors are on the meta device (the
    others). It may validate, collectively. On the other ranks the data then lands in its result's
    :meth:`~Prepared.destinations` (fresh CPU tensors elsewhere). Returns what was loaded and
    ``prepare``'s result rebound to the tensors holding the data.
    """

    def load() -> tuple[str, Any, Any]:
        chosen = Path(path)
        if chosen.is_dir() and not is_foreign_source(chosen):
            latest = latest_checkpoint(chosen, verify=True)
            if latest is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in folder {str(chosen)!r} (seen from rank 0)")
            chosen = latest
        opened = open_checkpoint(chosen, map_location="cpu", mmap=mmap, weights_only=weights_only, verify=verify)
        return str(chosen), opened.obj, None if opened.parts is None else parts_to_fields(opened.parts)

    mmapped = mmap and dist.get_rank() == 0  # the others receive into memory of their own
    seen: list[tuple[Any, P]] = []  # (the object prepare saw, its result): broadcast_loaded keeps no result

    def as_loaded(view: tuple[str, Any, Any]) -> Loaded:  # a foreign source's parts travel as a plain dict
        parts = None if view[2] is None else parts_from_fields(view[2])
        return Loaded(Path(view[0]), view[1], mmapped=mmapped, collective=True, parts=parts)

    def prepare_view(view: tuple[str, Any, Any]) -> dict[int, torch.Tensor]:
        prepared = prepare(as_loaded(view))
        seen.append((view[1:], prepared))
        return prepared.destinations() if dist.get_rank() != 0 else {}

    arrived_view = broadcast_loaded(load, bucket_bytes=bucket_bytes, prepare=prepare_view)
    ((view, prepared),) = seen
    # both objects are rank 0's structure, one holding what prepare saw, the other the data: pair them in order
    pairs = zip(iter_tensors(view), iter_tensors(arrived_view[1:]), strict=True)
    return as_loaded(arrived_view), prepared.rebind({id(old): new for old, new in pairs})
