"""What a resume reads, decided once: a :class:`Source` (which kind, which path, broadcast or not).

:func:`~dist_resume._source.consensus.resolve_source` decides it for ``resume`` (collective for a
``CheckpointManager`` folder); :func:`local_source` for a reader on one rank (``load_checkpoint``, the CLI).
:func:`~dist_resume._source.read.read_source` then reads it without asking again what it is.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .._core.location import Location
from .._foreign.folders import foreign_kind, is_manager_folder, unrecognised_folder
from .._format.load import load_torch_file
from .._layout.layout import Layout

__all__ = ["SourceKind", "Source", "local_source"]


class SourceKind(enum.Enum):
    """What a :class:`Source` is."""

    FILE = "a torch file"  # torch.save's zip (or legacy) format, any layout inside
    FOLDER_NEWEST = "the newest complete checkpoint of a CheckpointManager folder"  # a file or a sharded folder
    FOREIGN = "a foreign checkpoint"  # an HF Trainer / Accelerate / DCP folder or a .safetensors file: see layout
    OWN_SHARDS = "this rank's own shards of an FSDP2 snapshot"  # each rank its own file, in its node's memory


@dataclass(frozen=True)
class Source:
    """A checkpoint to read: ``path`` (the file, or a foreign folder), ``layout`` (a foreign source's, else None),
    ``folder`` (the ``CheckpointManager`` folder a ``FOLDER_NEWEST`` file was chosen from) and ``broadcast``
    (global rank 0 reads it and the others receive it through torch.distributed)."""

    kind: SourceKind
    path: Location
    layout: Layout | None = None
    folder: Location | None = None
    broadcast: bool = False

    @classmethod
    def at(cls, path: Location, layout: Layout | None, *, broadcast: bool = False) -> Source:
        """A torch file (``layout`` None) or a foreign source of ``layout``."""
        kind = SourceKind.FILE if layout is None else SourceKind.FOREIGN
        return cls(kind, path, layout, broadcast=broadcast)

    @classmethod
    def own_shards(cls, path: Location) -> Source:
        """This rank's file of an FSDP2 snapshot (:mod:`~dist_resume._foreign.own_shards`): each rank reads its own."""
        return cls(SourceKind.OWN_SHARDS, path, Layout.SHARDED)

    @classmethod
    def newest(cls, path: Location, folder: Location, layout: str, *, broadcast: bool = False) -> Source:
        """The checkpoint chosen in a ``CheckpointManager`` folder: a torch file, or a sharded checkpoint folder
        (``layout``: the chosen :class:`~dist_resume._source.integrity.CheckpointInfo`'s)."""
        sharded = Layout.SHARDED if layout == Layout.SHARDED.value else None
        return cls(SourceKind.FOLDER_NEWEST, path, sharded, folder=folder, broadcast=broadcast)


def local_source(path: Location) -> Source:
    """The :class:`Source` at ``path`` as this rank alone sees it: a torch file, a ``.safetensors`` file or a
    foreign folder. Local.

    A ``CheckpointManager`` folder or an empty one raises :class:`CheckpointNotFoundError` (pass it to
    ``resume``, which picks its newest complete checkpoint with every rank); any other folder
    :class:`NotACheckpointError`, naming its files and the known folders, or the checkpoint folders it
    holds one level down (an HF Trainer ``output_dir``).
    """
    p = path
    layout = foreign_kind(p)
    if layout is None and p.is_dir():
        if is_manager_folder(p) or not any(p.iterdir()):  # check_file's error says what to pass instead
            load_torch_file(p)
        raise unrecognised_folder(p)
    return Source.at(p, layout)
