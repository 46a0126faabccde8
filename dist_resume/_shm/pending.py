"""A snapshot written into its slot and not yet committed: its commit (the CRC-32s taken, a file laid out sealed,
then the record written: steps (3) and (4) of :mod:`.write`) or its abort; and the claim that keeps one writer per
folder and part in this process (a second begin before the first is committed or aborted is refused). Torch-free.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointWriteError, UsageError
from .._format.atomic import write_error
from . import slots
from .layout import FileLayout, seal
from .place import open_owned
from .read import file_crc
from .record import SLOTS, Snapshot, data_name, record_lock, write_record
from .space import NO_SPACE, free_bytes, no_space_error

__all__ = ["PendingSnapshot", "claim", "release", "drop", "write_failure"]

_claimed: set[tuple[Path, str]] = set()  # (directory, part) with a write begun and not yet committed or aborted
_claimed_lock = threading.Lock()


def _forget_in_child() -> None:
    """In a forked child: the parent's writes under way are not the child's."""
    global _claimed_lock
    _claimed_lock = threading.Lock()
    _claimed.clear()


os.register_at_fork(after_in_child=_forget_in_child)


class PendingSnapshot:
    """A snapshot whose data is written and not yet committed: :meth:`commit` makes it complete, :meth:`abort`
    drops it. Until one of them runs, readers see the part's previous snapshot as the newest. Local."""

    def __init__(
        self,
        *,
        store: Path,
        folder: str,
        part: str,
        slot: str,
        step: int,
        seq: int,
        size: int,
        metadata: dict[str, Any],
        identity: str,
        crc32: int | None = None,
        layout: FileLayout | None = None,
    ) -> None:
        self.path = store / data_name(part, slot)
        self.step = step
        self.size = size
        self.crc32 = crc32  # the CRC-32 of the bytes as written, when known: the commit reads nothing back
        self._layout = layout  # written into the slot's mapping: the commit seals it (its CRC-32s)
        self._fields = (folder, part, slot, seq, metadata, identity)
        self._done = False
        self._lock = threading.Lock()

    def commit(self) -> Snapshot:
        """Compute the data file's CRC-32 and write its commit record: the snapshot is then complete and the newest.

        A file laid out by :func:`begin_copy` is sealed first: each record's CRC-32 taken from the slot's mapping and
        written into the zip, then the whole file's. May run in another thread. Raises :class:`CheckpointWriteError`
        (the data file is removed) when the file changed since it was written or the record cannot be written;
        :class:`UsageError` when already done."""
        folder, part, slot, seq, metadata, identity = self._fields
        with self._lock:
            self._finish("commit")
            try:
                if self._layout is not None:
                    crc, size = self._seal(self._layout), self._layout.size
                elif self.crc32 is not None:
                    crc, size = self.crc32, os.stat(self.path, follow_symlinks=False).st_size
                else:
                    fd, _ = open_owned(self.path)
                    try:
                        crc, size = file_crc(fd)
                    finally:
                        os.close(fd)
                if size != self.size:
                    raise CheckpointWriteError(
                        f"the snapshot of step {self.step} changed after it was written ({size} bytes, "
                        f"{self.size} written): another process writes {str(self.path)!r}; one writer per folder"
                    )
                snapshot = Snapshot(
                    step=self.step,
                    path=self.path,
                    size=size,
                    created=time.time(),
                    metadata=metadata,
                    part=part,
                    slot=slot,
                    seq=seq,
                    crc32=crc,
                    folder=folder,
                    persisted=False,
                    identity=identity,
                )
                with record_lock(self.path.parent):
                    write_record(snapshot)
            except BaseException as err:
                drop(self.path)
                if isinstance(err, OSError):
                    raise write_failure(self.path, self.step, self.size, err) from err
                raise
            finally:
                release(self.path.parent, part)
        if self._layout is not None:
            _warm_other(self.path.parent, part, slot, size)
        return snapshot

    def _seal(self, layout: FileLayout) -> int:
        mm = slots.mapped(self.path, layout.size)
        if mm is None:
            raise CheckpointWriteError(
                f"the snapshot of step {self.step} was removed or replaced before its commit: another process writes "
                f"{str(self.path)!r}; one writer per folder"
            )
        with memoryview(mm) as view:
            crc = seal(view, layout)
        # writes through a mapping whose pages are in place leave the file's time as it was
        os.utime(self.path, follow_symlinks=False)
        return crc

    def abort(self) -> None:
        """Remove the uncommitted data file; the part's previous snapshot stays the newest. Idempotent."""
        with self._lock:
            if self._done:
                return
            self._done = True
            drop(self.path)
            release(self.path.parent, self._fields[1])

    def _finish(self, verb: str) -> None:
        if self._done:
            raise UsageError(f"this snapshot of step {self.step} was already committed or aborted; cannot {verb} it")
        self._done = True


def _warm_other(store: Path, part: str, slot: str, size: int) -> None:
    """After the first snapshot into ``slot``: the other slot made and mapped when it does not exist yet, so that the
    next snapshot copies into pages in place too. A failure is left for that snapshot to report."""
    other = next(s for s in SLOTS if s != slot)
    try:
        slots.warm(store / data_name(part, other), size)
    except OSError:
        pass


def drop(path: Path) -> None:
    """Unmap and remove a slot's data file."""
    slots.forget(path)
    path.unlink(missing_ok=True)


def release(store: Path, part: str) -> None:
    """The claim of ``part`` of ``store`` let go (its pending snapshot committed or aborted, or its begin failed)."""
    with _claimed_lock:
        _claimed.discard((store, part))


def claim(store: Path, part: str, step: int) -> None:
    """Claim ``part`` of ``store`` for the write of ``step``; :class:`UsageError` while a write of it is pending."""
    with _claimed_lock:
        if (store, part) in _claimed:
            raise UsageError(
                f"a snapshot of part {part!r} of this folder is still being written (step {step} asked for)",
                hint="commit() or abort() the pending snapshot before beginning the next",
            )
        _claimed.add((store, part))


def write_failure(path: Path, step: int, need: int, err: OSError) -> CheckpointWriteError:
    """The error of a write of ``path`` that raised ``err``: shared memory full (what is needed, what is free), or
    another write error naming the file."""
    if err.errno in NO_SPACE:
        try:
            free: int | None = free_bytes(path.parent)
        except OSError:
            free = None
        return no_space_error(path.parent, step, need, free)
    return write_error(path, err)
