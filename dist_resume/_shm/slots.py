"""The slots' data files, kept open and mapped across snapshots: a snapshot copies into pages that are already there.

A page of a new tmpfs file is allocated and zeroed at its first touch, which costs more than the copy into it (FACTS
25); a mapping made anew faults every page in again. So this process keeps each slot it wrote mapped (one
``MAP_SHARED`` mapping of the whole file) and the next snapshot into that slot, of the same size, copies into the same
pages: no new file, no ``ftruncate``, no page fault. A slot is made anew (the old file unlinked: a reader holding it
keeps it whole) when this process has not mapped it yet, when its size changes, or when the file at its name is no
longer the one mapped (removed, replaced). A new file's pages are allocated with ``posix_fallocate`` before they are
mapped, so a full shared memory is an ``ENOSPC`` there and never a ``SIGBUS`` in the copy. The node's other
processes, which copy a share of a snapshot into the file its writer made, keep their mapping of it the same way
(:func:`attach_slot`). What the layer above attaches to a kept mapping (an accelerator's registration of its pages) is
undone just before it is unmapped: :func:`when_unmapped`. Torch-free.
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["map_slot", "attach_slot", "mapped", "warm", "when_unmapped", "forget", "forget_store"]

_OPEN_RW: Final = os.O_RDWR | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_CREATE_NEW: Final = _OPEN_RW | os.O_CREAT | os.O_EXCL
_POPULATE: Final = getattr(mmap, "MAP_POPULATE", 0)  # fault every page in when mapping (Linux)


@dataclass(frozen=True)
class _Slot:
    fd: int
    mm: mmap.mmap
    inode: tuple[int, int]  # (st_dev, st_ino) of the file mapped
    size: int
    unmapped: list[Callable[[], None]] = field(default_factory=list)  # called before the mapping is dropped


_slots: dict[Path, _Slot] = {}
_lock = threading.Lock()


def _forget_in_child() -> None:
    """In a forked child: the parent's mappings are not the child's to write, unregister or unmap (the child's copies
    go with it), and a lock a parent's thread held at the fork is not held here."""
    global _lock
    _lock = threading.Lock()
    _slots.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _same_file(path: Path, slot: _Slot) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == slot.inode and st.st_size == slot.size


def _close(slot: _Slot) -> None:
    try:
        for callback in slot.unmapped:
            callback()
    finally:
        try:
            slot.mm.close()
        except BufferError:  # a view of it is still alive (a commit reading it): unmapped once the view is gone
            pass
        os.close(slot.fd)


def _allocate(fd: int, size: int) -> None:
    """Give ``fd`` ``size`` bytes whose pages exist: ``ENOSPC`` here rather than ``SIGBUS`` in a mapping."""
    os.ftruncate(fd, size)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as err:
        if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise


def _create(path: Path, size: int) -> _Slot:
    path.unlink(missing_ok=True)
    fd = os.open(path, _CREATE_NEW, 0o600)
    try:
        _allocate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        path.unlink(missing_ok=True)
        raise
    return _Slot(fd, mm, (st.st_dev, st.st_ino), size)


def map_slot(path: Path, size: int) -> mmap.mmap:
    """A writable shared mapping of the whole ``size``-byte data file ``path`` (``size`` > 0), its pages in place:
    the one this process mapped before when the file there is still that one, of that size; else a new file. Local.

    Raises ``OSError`` (``ENOSPC`` when shared memory cannot hold it; nothing is left at ``path`` then)."""
    with _lock:
        slot = _slots.get(path)
        if slot is not None and slot.size == size and _same_file(path, slot):
            return slot.mm
        if slot is not None:
            del _slots[path]
            _close(slot)
        slot = _create(path, size)
        _slots[path] = slot
        return slot.mm


def attach_slot(path: Path, size: int) -> mmap.mmap:
    """A writable shared mapping of the ``size``-byte data file ``path`` that another process of this user made and
    sized (the node's writer, :func:`map_slot`): the one this process mapped before when the file there is still that
    one, else a new mapping of it. Never creates, truncates or unlinks a file. Mappings this process holds of files
    no longer at their path in the same directory are dropped first, so that their memory is freed. Local.

    Raises ``OSError`` (the file is gone, another size, or not this user's regular file)."""
    with _lock:
        stale = [p for p, s in _slots.items() if p.parent == path.parent and not _same_file(p, s)]
        for old in stale:
            _close(_slots.pop(old))
        slot = _slots.get(path)
        if slot is not None:
            if slot.size == size and _same_file(path, slot):
                return slot.mm
            del _slots[path]
            _close(slot)
        fd = os.open(path, _OPEN_RW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_size != size:
                raise OSError(errno.ESTALE, f"{path} is not this user's {size}-byte snapshot file", str(path))
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.close(fd)
            raise
        _slots[path] = _Slot(fd, mm, (st.st_dev, st.st_ino), size)
        return mm


def mapped(path: Path, size: int) -> mmap.mmap | None:
    """The mapping of ``path`` this process holds when the file there is still the one mapped, of ``size`` bytes;
    None otherwise. Never creates one. Local."""
    with _lock:
        slot = _slots.get(path)
        return slot.mm if slot is not None and slot.size == size and _same_file(path, slot) else None


def warm(path: Path, size: int) -> None:
    """Make and map a ``size``-byte slot at ``path`` ahead of its first snapshot, when nothing is there yet (a slot
    that holds a snapshot is never touched), so that the first snapshot into it copies into pages in place too. Local.

    Raises ``OSError`` (``ENOSPC``: nothing is left at ``path``)."""
    with _lock:
        if path in _slots or os.path.lexists(path):
            return
        _slots[path] = _create(path, size)


def when_unmapped(mm: mmap.mmap, callback: Callable[[], None]) -> bool:
    """Call ``callback()`` once, just before this process drops ``mm``, a mapping it keeps (:func:`forget`,
    :func:`forget_store`, a slot made anew, a stale mapping dropped by :func:`attach_slot`), while its pages are still
    mapped: what the caller attached to it is undone there. False, and nothing kept, when ``mm`` is not a mapping this
    process keeps. ``callback`` may run in any thread, perhaps under this module's lock: it must neither raise nor
    call this module. Local."""
    with _lock:
        for slot in _slots.values():
            if slot.mm is mm:
                slot.unmapped.append(callback)
                return True
    return False


def forget(path: Path) -> None:
    """Unmap ``path`` in this process (before it is unlinked, so that its memory is freed). Local; idempotent."""
    with _lock:
        slot = _slots.pop(path, None)
    if slot is not None:
        _close(slot)


def forget_store(store: Path) -> None:
    """Unmap every slot of the directory ``store`` in this process. Local; idempotent."""
    with _lock:
        paths = [p for p in _slots if p.parent == store]
    for path in paths:
        forget(path)
