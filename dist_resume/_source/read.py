"""Reading a :class:`~dist_resume._source.source.Source`: on this rank, or on rank 0 and broadcast to every rank.

Both yield a :class:`SourceContents`: a torch file's object (split into parts later, with the live model's keys),
or a foreign source's :class:`CheckpointParts` (split already by the reader that knows its files).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Final

import torch.distributed as dist

from .._core.errors import CheckpointError
from .._core.location import Location, RemotePath
from .._core.log import log_rank0
from .._core.text import preview
from .._core.types import MapLocation
from .._dist.broadcast import DEFAULT_BUCKET_BYTES, Incoming, receive_structure
from .._dist.env import is_distributed
from .._foreign.folders import read_foreign_folder
from .._foreign.safetensors_read import read_safetensors
from .._format.load import load_torch_file
from .._format.ranged import RangedArchive, open_ranged
from .._format.safe_open import reading, still_there
from .._format.sniff import FileKind, check_file, file_kind
from .._format.zip_verify import verify_zip
from .._layout.layout import CheckpointParts, Layout
from .consensus import choose_newest
from .integrity import verify_source
from .listing import RELISTS
from .source import Source, SourceKind

__all__ = ["SourceContents", "read_source", "read_broadcast", "parts_to_fields", "parts_from_fields"]

_MORE: Final = (("more_models", "model"), ("more_optimizers", "optimizer"), ("more_schedulers", "scheduler"))


@dataclass(frozen=True)
class SourceContents:
    """A :class:`Source` as read: ``obj`` (a torch file's object) or ``parts`` (a foreign source, split already);
    whether its tensors map the file (what is kept must be copied out), whether it is collective (every rank
    holds rank 0's contents, so the ranks must agree on its validation before any of them changes anything), and
    ``ranged``: an object on a store whose tensors in ``obj`` are stand-ins, their data read on demand."""

    source: Source
    obj: Any = None
    parts: CheckpointParts | None = None
    mmapped: bool = False
    collective: bool = False
    ranged: RangedArchive | None = None

    @property
    def path(self) -> Location:
        return self.source.path


def read_source(
    source: Source,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
    ranged: bool = False,
    striped: bool = False,
) -> SourceContents:
    """Read ``source`` on this rank. Local.

    A torch file goes through :func:`~dist_resume._format.load.load_torch_file` (``map_location`` None: this
    rank's device); a ``.safetensors`` file and a foreign folder through their readers (``map_location`` None:
    the CPU). ``verify=True`` first checks every torch file's CRC-32s and every safetensors header. With ``ranged``
    a torch file on an object store is read as its structure, its tensors stand-ins whose data the contents'
    ``ranged`` archive reads later (``weights_only=False`` reads it whole instead). With ``striped`` a local torch zip
    file is read the same way, its records left for positional reads (a striped resume,
    :mod:`~dist_resume._checkpoint.striped`, whose ranks read and check them, ``verify`` included, each its share; a
    legacy-format file is loaded whole).

    A folder's newest checkpoint chosen by this process alone (no process group) that a writer's rotation deletes
    before it is read is chosen again from a new listing (:data:`~dist_resume._source.listing.RELISTS` times at
    most): a reader racing a writer reads the newest checkpoint there is, never fails for the one it missed.
    """
    for _ in range(RELISTS - 1):
        try:
            return _read_one(source, map_location, mmap, weights_only, verify, ranged, striped)
        except (CheckpointError, OSError):
            if source.kind is not SourceKind.FOLDER_NEWEST or source.folder is None or is_distributed():
                raise
            if still_there(source.path):
                raise
        chosen = choose_newest(source.folder)
        source = Source.newest(chosen.path, source.folder, chosen.layout, broadcast=source.broadcast)
    return _read_one(source, map_location, mmap, weights_only, verify, ranged, striped)


def _read_one(
    source: Source,
    map_location: MapLocation,
    mmap: bool,
    weights_only: bool,
    verify: bool,
    ranged: bool,
    striped: bool = False,
) -> SourceContents:
    with reading(source.path):  # removed since it was chosen (a writer's rotation): CheckpointNotFoundError
        return _read_contents(source, map_location, mmap, weights_only, verify, ranged, striped)


def _read_contents(
    source: Source,
    map_location: MapLocation,
    mmap: bool,
    weights_only: bool,
    verify: bool,
    ranged: bool,
    striped: bool = False,
) -> SourceContents:
    p = source.path
    local_zip = striped and source.layout is None and not isinstance(p, RemotePath) and weights_only
    if local_zip and file_kind(check_file(p)) is not FileKind.LEGACY:  # records read (and verified) striped, later
        archive = open_ranged(p)
        return SourceContents(source, obj=archive.obj, ranged=archive)
    if ranged and source.layout is None and isinstance(p, RemotePath) and weights_only:
        if verify:
            verify_zip(p)  # one pass over the object, by ranges
        archive = open_ranged(p)
        return SourceContents(source, obj=archive.obj, ranged=archive)
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
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[SourceContents, Incoming]:
    """Global rank 0 reads ``source`` (decided already, the same on every rank); every rank gets its structure.

    Collective. Only rank 0 touches the filesystem, so the other ranks need not see the file; a failure reading it
    raises on every rank. A checkpoint on an object store is read by rank 0 by ranges as it is sent (its contents'
    tensors are stand-ins on rank 0 too; ``ranged`` reads them), never copied whole. The contents' tensors are rank 0's own there and meta stand-ins elsewhere: validate on them,
    then move the data with :meth:`~dist_resume._dist.broadcast.Incoming.send` (the returned ``Incoming``), into the
    destinations each rank chooses.
    """
    rank0 = dist.get_rank() == 0
    view: tuple[Any, Any] | None = None  # rank 0: (a torch file's object, a foreign source's parts as fields)
    failure: Exception | None = None
    ranged: RangedArchive | None = None  # rank 0, a checkpoint on a store: its data read by ranges as it is sent
    if rank0:  # read before the collective, so that it is not a callback from _dist into this layer
        try:
            read = read_source(
                source, map_location="cpu", mmap=mmap, weights_only=weights_only, verify=verify, ranged=True
            )
            view = (read.obj, None if read.parts is None else parts_to_fields(read.parts))
            ranged = read.ranged
        except Exception as err:  # every rank raises it, from receive_structure
            failure = err

    def load() -> tuple[Any, Any]:
        if failure is not None:
            raise failure
        assert view is not None  # rank 0 read it or failed; the others never call load
        return view

    incoming = receive_structure(load, bucket_bytes=bucket_bytes, lazy=ranged)
    obj, fields = incoming.obj
    parts = None if fields is None else parts_from_fields(fields)
    mapped = mmap and rank0 and ranged is None
    return SourceContents(source, obj=obj, parts=parts, mmapped=mapped, collective=True, ranged=ranged), incoming
