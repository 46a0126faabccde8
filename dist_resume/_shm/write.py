"""Writing one snapshot into a folder's shared-memory directory, double-buffered and complete only once committed.

Each part has two slots; a write goes into the slot that does not hold the part's newest committed snapshot, so the
newest is never the one overwritten. The order: the free space is checked first (nothing is touched when the
snapshot cannot fit), then (1) the slot's old record is removed, (2) its data file is written, (3) its CRC-32 is
computed, (4) its record is written (a rename). A process killed anywhere in that leaves the other slot's snapshot as
the newest. (The newest is told by the records and the data files' sizes, never by reading a whole file: a snapshot
damaged in place, its size intact, is not recognised until its CRC-32 is checked.)

Two ways to write (2): :func:`begin_snapshot` runs the caller's ``dump(f)`` (``torch.save(payload, f)``) into a new
file, taking the CRC-32 as the bytes go; :func:`begin_copy` writes a file laid out beforehand
(:class:`~dist_resume._shm.layout.FileLayout`) into the slot's mapping, which this process keeps across snapshots
(:mod:`~dist_resume._shm.slots`), and the caller's ``fill`` copies the data in: the one pass over the data, and
the CRC-32s (the zip's and the file's) are left to (3). Either returns at the end of (2), which is what the training
loop waits for; :meth:`~.pending.PendingSnapshot.commit` is (3)-(4) and may run in a background thread
(:mod:`.pending`). One writer per folder and part: a second begin in this process before the first is committed is
refused. Torch-free.
"""

from __future__ import annotations

import mmap
import os
import stat
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, BinaryIO, Final

from .._core.errors import UsageError
from .._core.location import Location
from . import slots
from .identity import make_identity
from .layout import FileLayout
from .pending import PendingSnapshot, claim, drop, release, write_failure
from .place import check_part, folder_key, make_store
from .read import slot_snapshots
from .record import (
    ENTRY,
    SLOTS,
    Snapshot,
    checked_metadata,
    checked_step,
    data_name,
    record_lock,
    record_name,
)
from .space import check_space

__all__ = ["PendingSnapshot", "begin_snapshot", "begin_copy", "write_snapshot"]

_CREATE_NEW: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


class _SlotFile:
    """The file ``dump`` writes: every byte written (a short write is retried), the ``OSError`` a write raised
    remembered, since ``torch.save`` replaces it with an opaque ``RuntimeError``, and the CRC-32 of the bytes as they
    are written (``crc``: None once ``dump`` seeks, since the bytes written are then not the file in order)."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.error: OSError | None = None
        self.crc: int | None = 0
        self.written = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += self._f.write(view[done:]) or 0
        except OSError as err:
            self.error = err
            raise
        if self.crc is not None:
            self.crc = zlib.crc32(view, self.crc)
        self.written += done
        return done

    def seek(self, *args: Any) -> int:
        self.crc = None
        return self._f.seek(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _remove_leftovers(store: Path, part: str) -> None:
    """Temporary records of this part that a killed commit left."""
    prefix = f".{part}."
    for name in os.listdir(store):
        if name.startswith(prefix) and name.endswith(".tmp") and ENTRY.match(name):
            (store / name).unlink(missing_ok=True)


def _reclaimed(path: Path) -> int:
    """The bytes freed by removing the slot's old data file (0 when it is absent or not this user's file)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() else 0


def _checked_size(value: object) -> int:
    if type(value) is not int or value < 0:
        raise UsageError(f"size_hint must be a non-negative int, got {value!r}")
    return value


def begin_snapshot(
    folder: Location,
    step: int,
    dump: Callable[[Any], None],
    *,
    size_hint: int,
    part: str = "state",
    metadata: Mapping[str, Any] | None = None,
    identity: str | None = None,
) -> PendingSnapshot:
    """Write a snapshot of ``folder`` at ``step`` into the free slot: ``dump(f)`` writes a standard torch file. Local.

    ``size_hint`` is the bytes the file will take (:func:`~dist_resume._shm.space.size_estimate`); when shared
    memory cannot hold it, :class:`CheckpointWriteError` says what is needed, what is free and how to get more, and
    nothing is touched. A write that fails (``ENOSPC``, an exception in ``dump``) removes the slot's partial file and
    leaves the previous snapshot the newest; an ``OSError`` becomes a :class:`CheckpointWriteError`, anything else is
    raised as it is. ``metadata``: a small JSON-able dict kept in the record (world size, epoch, ...). ``identity``:
    the folder's (:mod:`~dist_resume._shm.identity`; None: the one the folder keeps, made when it has none). A
    ``step`` past int64 is a :class:`UsageError`. Returns the :class:`PendingSnapshot` to commit.

    Example::

        >>> pending = begin_snapshot(Path("ckpts"), 80, lambda f: torch.save(payload, f), size_hint=2**20)
        >>> pending.commit().step
        80
    """
    return _begin(folder, step, size_hint, part, metadata, identity, _dumped(dump))


def _begin(
    folder: Location,
    step: int,
    need: int,
    part: str,
    metadata: Mapping[str, Any] | None,
    identity: str | None,
    write: _Writer,
) -> PendingSnapshot:
    step = checked_step(step)
    need = _checked_size(need)
    part = check_part(part)
    meta = checked_metadata(metadata)
    mine = make_identity(folder) if identity is None else identity
    store = make_store(folder)
    key = folder_key(folder)
    claim(store, part, step)
    try:
        committed = slot_snapshots(store, key, part, identity=mine)
        newest = max(committed, key=lambda s: s.seq, default=None)
        slot = SLOTS[0] if newest is None else next(s for s in SLOTS if s != newest.slot)
        path = store / data_name(part, slot)
        check_space(store, step, need, _reclaimed(path))
        with record_lock(store):
            (store / record_name(part, slot)).unlink(missing_ok=True)  # (1): from here the slot holds no snapshot
        _remove_leftovers(store, part)
        size, crc, layout = write(path, step, need)  # (2)
        seq = max((s.seq for s in committed), default=-1) + 1
        return PendingSnapshot(
            store=store,
            folder=key,
            part=part,
            slot=slot,
            step=step,
            seq=seq,
            size=size,
            metadata=meta,
            identity=mine,
            crc32=crc,
            layout=layout,
        )
    except BaseException:
        release(store, part)
        raise


_Writer = Callable[[Path, int, int], tuple[int, int | None, FileLayout | None]]
"""Step (2): writes the slot's data file ``path`` of the snapshot of ``step`` (``need`` bytes expected); returns its
size, its CRC-32 when known and its layout when the commit must seal it."""


def _dumped(dump: Callable[[Any], None]) -> _Writer:
    def write(path: Path, step: int, need: int) -> tuple[int, int | None, FileLayout | None]:
        drop(path)  # a new file: a reader still holding the old one keeps reading it whole
        recorder: _SlotFile | None = None
        try:
            fd = os.open(path, _CREATE_NEW, 0o600)
            with open(fd, "wb", buffering=0) as f:
                recorder = _SlotFile(f)
                dump(recorder)
                size = os.fstat(f.fileno()).st_size
        except BaseException as err:
            path.unlink(missing_ok=True)
            cause = recorder.error if recorder is not None and recorder.error is not None else err
            if isinstance(cause, OSError):
                raise write_failure(path, step, need, cause) from err
            raise
        return size, (recorder.crc if recorder.written == size else None), None

    return write


def _copied(layout: FileLayout, fill: Callable[[Path, mmap.mmap], None]) -> _Writer:
    def write(path: Path, step: int, need: int) -> tuple[int, int | None, FileLayout | None]:
        try:
            mm = slots.map_slot(path, layout.size)
        except OSError as err:
            raise write_failure(path, step, need, err) from err
        try:
            for offset, data in layout.fixed:
                mm[offset : offset + len(data)] = data
            fill(path, mm)
        except BaseException as err:
            drop(path)
            if isinstance(err, OSError):
                raise write_failure(path, step, need, err) from err
            raise
        return layout.size, None, layout

    return write


def begin_copy(
    folder: Location,
    step: int,
    layout: FileLayout,
    fill: Callable[[Path, mmap.mmap], None],
    *,
    part: str = "state",
    metadata: Mapping[str, Any] | None = None,
    identity: str | None = None,
) -> PendingSnapshot:
    """Write a snapshot of ``folder`` at ``step`` laid out as ``layout`` into the free slot; ``fill(path, mm)`` copies
    the regions' data into ``mm``, a writable mapping of the whole file ``path`` (the node's other processes may map
    ``path`` with :func:`~dist_resume._shm.slots.attach_slot` and copy a share while ``fill`` runs). Local.

    The slot's file and mapping are this process's from the last snapshot into that slot when the size is the same
    (:func:`~dist_resume._shm.slots.map_slot`): the copy is the only pass over the data. Its CRC-32s are left to
    :meth:`PendingSnapshot.commit`, which seals the file; until then the snapshot is not complete and the part's
    previous one stays the newest. Space and failures as :func:`begin_snapshot` (``fill`` raising removes the slot's
    file). Returns the :class:`PendingSnapshot` to commit.

    Example::

        >>> pending = begin_copy(Path("ckpts"), 80, layout, lambda path, mm: copy_tensors_into(mm))
        >>> pending.commit().step
        80
    """
    return _begin(folder, step, layout.size, part, metadata, identity, _copied(layout, fill))


def write_snapshot(
    folder: Location,
    step: int,
    dump: Callable[[Any], None],
    *,
    size_hint: int,
    part: str = "state",
    metadata: Mapping[str, Any] | None = None,
    identity: str | None = None,
) -> Snapshot:
    """:func:`begin_snapshot` then :meth:`PendingSnapshot.commit`: the snapshot complete when it returns. Local.

    Example::

        >>> write_snapshot(Path("ckpts"), 80, lambda f: torch.save({"step": 80}, f), size_hint=2**16).step
        80
    """
    pending = begin_snapshot(folder, step, dump, size_hint=size_hint, part=part, metadata=metadata, identity=identity)
    return pending.commit()
