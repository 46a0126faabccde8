"""A sharded checkpoint folder against its manifest: every listed file there, regular, of its size and CRC-32, no
other file, and a ``.metadata`` that describes the listed shards.

Torch-free: this module imports nothing but the standard library, the error classes, the torch-free path types and
store layer, and the modules beside it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from .._core.errors import CheckpointCorruptError
from .._core.location import Location
from .dcp.entries import entries_problem
from .dcp.view import BadMetadata, metadata_view
from .manifest import DCP_METADATA, MANIFEST, REQUIRED, FileEntry, Manifest, file_crc32
from .safe_open import entry_of, folder_entries, read_in_folder
from .sharded_layout import held_keys

__all__ = ["FileProblem", "manifest_problems", "rank_share", "declared_keys"]


@dataclass(frozen=True, slots=True)
class FileProblem:
    """A file of the folder that differs from the manifest: missing, another size, or (``crc``) another CRC-32."""

    name: str
    problem: str
    crc: bool = False


def rank_share(manifest: Manifest, rank: int, world_size: int) -> frozenset[str]:
    """The files whose CRC-32 ``rank`` checks when ``world_size`` ranks split the check of the folder: each about the
    same bytes (the largest file first, to the rank with the fewest bytes so far). Local; the same on every rank."""
    loads = [(0, r) for r in range(world_size)]
    mine = set()
    for entry in sorted(manifest.files, key=lambda e: (-e.size, e.name)):
        load, r = heapq.heappop(loads)
        heapq.heappush(loads, (load + entry.size, r))
        if r == rank:
            mine.add(entry.name)
    return frozenset(mine)


def manifest_problems(
    folder: Location, manifest: Manifest, *, verify: bool, share: frozenset[str] | None = None
) -> list[FileProblem]:
    """How the folder differs from ``manifest``; [] for a sound folder. Local.

    Each listed file must be a regular file (no link, FIFO, socket or device node) of the listed size, and with
    ``verify`` have the listed CRC-32 (reads every file once; ``share``: only those files, a rank's part of a check
    the ranks split, :func:`rank_share`); the folder must hold nothing else (an unlisted file is
    damage: no reader may use a byte integrity does not cover); and ``.metadata`` must describe what the listed shards
    hold (:func:`~dist_resume._format.dcp.view.metadata_view`: every chunk stored inside a listed shard, no two entries
    over the same bytes, every element of every tensor covered exactly once, the DCP state's entries those the
    manifest names), and with ``verify`` that each stored entry's header is sound and a chunk's says the dtype and
    shape ``.metadata`` declares (:func:`~dist_resume._format.dcp.entries.entries_problem`, for the files whose CRC-32
    this call checks).
    """
    root = folder
    problems = []
    listed = {entry.name: entry for entry in manifest.files}
    for found in folder_entries(root):
        if found.name != MANIFEST and found.name not in listed:
            kind = "" if found.regular else f" ({found.why_not_file(root)})"
            problems.append(FileProblem(found.name, f"is not listed in the manifest{kind}"))
    for entry in manifest.files:
        problem = _file_problem(root, entry, verify and (share is None or entry.name in share))
        if problem is not None:
            problems.append(problem)
    if not problems:
        shards = {e.name: e.size for e in manifest.files if e.name not in REQUIRED}
        wrong = None
        try:
            data = read_in_folder(root, DCP_METADATA, listed[DCP_METADATA].size)
            view = metadata_view(data, shards, manifest.contents)
            if verify:  # the deep check: each stored entry's header against .metadata, beside its CRC-32
                wrong = entries_problem(root, view, shards.keys() if share is None else share)
        except (BadMetadata, CheckpointCorruptError, OSError) as err:
            wrong = str(err)
        if wrong is not None:
            problems.append(FileProblem(DCP_METADATA, f"is damaged ({wrong[:300]})"))
    return problems


def _file_problem(root: Location, entry: FileEntry, verify: bool) -> FileProblem | None:
    try:
        found = entry_of(root, entry.name)
    except FileNotFoundError:
        return FileProblem(entry.name, "is missing")
    except OSError as err:
        return FileProblem(entry.name, f"cannot be read ({err.strerror or err})")
    why = found.why_not_file(root)
    if why is not None:
        return FileProblem(entry.name, why)
    if found.size != entry.size:
        return FileProblem(entry.name, f"holds {found.size} bytes, the manifest says {entry.size}")
    if not verify:
        return None
    try:
        crc = file_crc32(root / entry.name)
    except (CheckpointCorruptError, OSError) as err:
        return FileProblem(entry.name, f"cannot be read ({getattr(err, 'strerror', None) or err})")
    if crc != entry.crc32:
        return FileProblem(entry.name, f"CRC-32 {crc:08x}, the manifest says {entry.crc32:08x}", crc=True)
    return None


def declared_keys(folder: Location, manifest: Manifest) -> dict[str, set[str]]:
    """The keys ``.metadata`` declares under each top-level entry of the DCP state (``model``: its state dict's keys),
    read without torch, for a folder :func:`manifest_problems` found sound. Local."""
    root = folder
    listed = {entry.name: entry for entry in manifest.files}
    shards = {e.name: e.size for e in manifest.files if e.name not in REQUIRED}
    data = read_in_folder(root, DCP_METADATA, listed[DCP_METADATA].size)
    try:
        return held_keys(metadata_view(data, shards, manifest.contents).places.values())
    except BadMetadata as err:  # changed since it was checked
        raise CheckpointCorruptError(f"{str(root / DCP_METADATA)!r} is damaged ({str(err)[:300]})") from None
