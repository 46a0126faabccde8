"""A snapshot copied to the checkpoint folder, marked as copied, and a folder's snapshots removed. Torch-free."""

from __future__ import annotations

import dataclasses
import logging
import os
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointCorruptError
from .._core.location import Location
from .._format.atomic import atomic_write
from . import slots
from .place import folder_key, open_owned, owned_store, store_dir
from .read import CHUNK, slot_snapshots, stale_snapshots
from .record import ENTRY, Snapshot, data_name, record_lock, record_name, write_record

__all__ = [
    "persist_snapshot",
    "open_snapshot",
    "copy_bytes",
    "check_copied",
    "mark_persisted",
    "retire_snapshot",
    "remove_stale",
    "remove_snapshots",
]

logger = logging.getLogger("dist_resume")  # the library logger (dist_resume._core.log imports torch)


def open_snapshot(path: Path, step: int) -> int:
    """A read-only descriptor of the data file of the snapshot of ``step`` at ``path`` (this user's regular file: see
    :func:`~dist_resume._shm.place.open_owned`); the caller closes it. Local. Raises
    :class:`CheckpointCorruptError` when it is gone or refused."""
    try:
        fd, _ = open_owned(path)
    except OSError as err:
        raise CheckpointCorruptError(
            f"the snapshot of step {step} is gone from shared memory ({err}); save from the live state"
        ) from err
    return fd


def copy_bytes(
    src: int, write: Callable[[memoryview, int], object], start: int = 0, end: int | None = None
) -> tuple[int, int]:
    """Read the bytes ``[start, end)`` of the descriptor ``src`` (``end`` None: to the file's end) in chunks of
    :data:`~dist_resume._shm.read.CHUNK`, hand each to ``write(data, offset)`` (``offset``: its place in ``src``;
    ``data`` is valid during the call only) and return their CRC-32 and length. Stops early at the file's end. Local.

    Example::

        >>> with open("w.bin", "rb") as f:  # a 3 MiB file, its second MiB
        ...     copy_bytes(f.fileno(), lambda data, offset: None, 1 << 20, 2 << 20)
        (..., 1048576)
    """
    crc, pos = 0, start
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    while end is None or pos < end:
        want = CHUNK if end is None else min(CHUNK, end - pos)
        n = os.preadv(src, [view[:want]], pos)
        if not n:
            break
        write(view[:n], pos)
        crc = zlib.crc32(view[:n], crc)
        pos += n
    return crc, pos - start


def check_copied(snapshot: Snapshot, crc: int, total: int, dest: Location) -> None:
    """Raise :class:`CheckpointCorruptError` unless the bytes copied from ``snapshot`` (their CRC-32 and length) are
    the ones its record describes. Local."""
    if (crc, total) != (snapshot.crc32, snapshot.size):
        raise CheckpointCorruptError(
            f"the snapshot of step {snapshot.step} ({snapshot.path}) reads {total} bytes with CRC-32 "
            f"{crc:08x}, its record says {snapshot.size} bytes, {snapshot.crc32:08x}: it was damaged or "
            f"overwritten while it was copied; nothing was written to {str(dest)!r}, save from the live state"
        )


def persist_snapshot(snapshot: Snapshot, dest: Location) -> Location:
    """Copy ``snapshot``'s data file to ``dest`` (a local path or a URL) atomically: the same standard torch file a
    save writes, through :func:`~dist_resume._format.atomic.atomic_write`. Local.

    The bytes copied are checked against the snapshot's size and CRC-32 before the file is put in place: a snapshot
    damaged or replaced meanwhile raises :class:`CheckpointCorruptError` (on a store, the upload's
    :class:`CheckpointWriteError`) and nothing appears at ``dest``. The copy reads the file it opened first, so a
    newer snapshot written into the same slot meanwhile cannot mix into it. Returns ``dest`` as a location.
    (Striped across a node's ranks: ``dist_resume._manager.snapshots.striped_copy``.)

    Example::

        >>> persist_snapshot(newest_snapshot(Path("ckpts")), Path("ckpts/ckpt_00000080.pt"))
        PosixPath('ckpts/ckpt_00000080.pt')
    """
    fd = open_snapshot(snapshot.path, snapshot.step)
    try:

        def copy(f: Any) -> None:
            crc, total = copy_bytes(fd, lambda data, _offset: f.write(data))
            check_copied(snapshot, crc, total, dest)

        written = atomic_write(dest, copy)
    finally:
        os.close(fd)
    logger.debug("copied the snapshot of step %d to %s", snapshot.step, written)
    return written


def mark_persisted(snapshot: Snapshot) -> Snapshot | None:
    """Rewrite ``snapshot``'s record with ``persisted=True`` (the folder holds a copy). Local.

    Returns the updated snapshot, or None when its slot holds another snapshot by now (a newer write replaced it):
    a record is never marked for a file it does not describe."""
    with record_lock(snapshot.path.parent):
        current = _current(snapshot)
        if current is None:
            return None
        marked = dataclasses.replace(current, persisted=True)
        write_record(marked)
    return marked


def _current(snapshot: Snapshot) -> Snapshot | None:
    """The snapshot ``snapshot``'s slot holds now, when it is still that one (its persisted flag aside); the caller
    holds the store's record lock."""
    store, key, part = snapshot.path.parent, snapshot.folder, snapshot.part
    found = [s for s in slot_snapshots(store, key, part, identity=snapshot.identity) if s.slot == snapshot.slot]
    if not found or found[0] != dataclasses.replace(snapshot, persisted=found[0].persisted):
        return None
    return found[0]


def retire_snapshot(snapshot: Snapshot) -> bool:
    """Remove ``snapshot``'s commit record (its slot's data file stays, for the next write): it no longer counts, and
    the part's other slot holds the newest. Local. False when its slot holds another snapshot by now."""
    with record_lock(snapshot.path.parent):
        if _current(snapshot) is None:
            return False
        (snapshot.path.parent / record_name(snapshot.part, snapshot.slot)).unlink(missing_ok=True)
    return True


def remove_stale(folder: Location, identity: str | None) -> list[Snapshot]:
    """Remove ``folder``'s snapshots on this node whose records name another identity than ``identity`` (the folder's;
    None: it has none): an earlier history of the folder's path (deleted and made again) or another run's, which
    must never be resumed. Their records go first, then their data files. Local; one WARNING when there were any.
    Returns the snapshots removed."""
    store = store_dir(folder)
    if store is None or not owned_store(store):
        return []
    names = (ENTRY.match(name) for name in os.listdir(store))
    parts = sorted({m.group("part") for m in names if m is not None and m.group("part") is not None})
    stale = [s for part in parts for s in stale_snapshots(store, folder_key(folder), part, identity)]
    if not stale:
        return []
    with record_lock(store):
        for snapshot in stale:
            _unlink_owned(store / record_name(snapshot.part, snapshot.slot))
    for snapshot in stale:
        slots.forget(snapshot.path)
        _unlink_owned(snapshot.path)
    steps = ", ".join(str(s.step) for s in sorted(stale, key=lambda s: s.step))
    logger.warning(
        "removed %d snapshot(s) of %s (steps %s) from shared memory: they belong to an earlier history of that path "
        "(the folder was deleted and made again, or is another run's) and are never resumed",
        len(stale),
        folder,
        steps,
    )
    return stale


def _kept(keep: Iterable[Snapshot]) -> set[str]:
    names: set[str] = set()
    for snapshot in keep:
        names.add(data_name(snapshot.part, snapshot.slot))
        names.add(record_name(snapshot.part, snapshot.slot))
    return names


def remove_snapshots(folder: Location, *, keep: Iterable[Snapshot] = ()) -> int:
    """Delete ``folder``'s snapshots on this node, except the slots of those in ``keep``, and the directory once
    empty. Local. Records go before data files, so a process killed meanwhile leaves no record without its data.

    Only this store's own names are removed (data files, records, temporary records) and only when this user owns
    them; anything else stays, with the directory. Returns the bytes freed."""
    store = store_dir(folder)
    if store is None or not owned_store(store):
        return 0
    kept = _kept(keep)
    names = sorted(
        (n for n in os.listdir(store) if ENTRY.match(n) and n not in kept), key=lambda n: not n.endswith(".json")
    )
    freed = 0
    with record_lock(store):
        for name in names:
            slots.forget(store / name)  # this process's mapping of a data file: its memory goes with the name
            freed += _unlink_owned(store / name)
    try:
        os.rmdir(store)
    except OSError:  # not empty: kept snapshots, or entries this store did not create
        pass
    return freed


def _unlink_owned(path: Path) -> int:
    try:
        st = os.lstat(path)
        if st.st_uid != os.getuid():
            logger.warning("leaving %s in place: it is owned by uid %d, not by this user", path, st.st_uid)
            return 0
        path.unlink()
    except FileNotFoundError:
        return 0
    return st.st_size


def release_mappings(folder: Location) -> None:
    """Unmap this process's mappings of ``folder``'s snapshot files (a local rank that copied its share into the
    writer's slots), so that their memory goes once the writer removes them; the files stay. Local; idempotent."""
    store = store_dir(folder)
    if store is not None:
        slots.forget_store(store)
