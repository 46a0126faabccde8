"""Checkpoints this process has checked, remembered by inode, size and modification time: each read once in its life.

Checking a checkpoint's every CRC-32 reads it whole (a 200,000-key file, a sharded folder of many GB): rotation,
``latest()`` and a resume's choice would each read the same unchanged checkpoint again. :func:`recall` answers for a
checkpoint whose signature (device, inode, size and modification time; a sharded folder's, with those of every entry
in it) is the one it had when it was checked; any change (a rewrite, a copy over it, a byte flipped by a tool that
sets the time) makes it a stranger again. A check with ``verify`` (every CRC) answers a later structural check too,
never the reverse.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from dataclasses import dataclass
from typing import Final

from .._core.location import Location, RemotePath, stat_of
from .integrity import CheckpointInfo

__all__ = ["Signature", "signature", "recall", "remember", "forget"]

Signature = tuple[int, int, int, int, str]
_MAX_KNOWN: Final = 10_000  # many folders in one long-lived process: forget the oldest half past this


@dataclass(frozen=True, slots=True)
class _Known:
    signature: Signature
    info: CheckpointInfo
    verified: bool  # every CRC-32 checked, not only the structure


_known: dict[Location, _Known] = {}
_lock = threading.Lock()  # rotation runs in an async save's thread too


def signature(path: Location) -> Signature | None:
    """A file's device, inode, size and modification time; a folder's, with the type, inode, size and time of every
    entry in it (an entry's link not followed); None when it cannot be looked at (gone). An object on a store: its
    size, time and ETag (hashed into the inode), asked afresh; a prefix's, with those of every object under it."""
    if isinstance(path, RemotePath):
        return _remote_signature(path)
    try:
        st = os.stat(path)  # a checkpoint linked into its folder is its target
        inside = hashlib.sha256()
        if stat.S_ISDIR(st.st_mode):
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                est = entry.stat(follow_symlinks=False)
                inside.update(f"{entry.name}\0{est.st_mode}\0{est.st_ino}\0{est.st_size}\0{est.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, inside.hexdigest())


def _remote_signature(path: RemotePath) -> Signature | None:
    try:
        st = path.info()
        inside = hashlib.sha256()
        if st.get("type") == "directory":
            for entry in sorted(path.iterdir(), key=lambda e: e.name):
                est = entry.stat()
                inside.update(f"{entry.name}\0{est.st_mode}\0{est.st_ino}\0{est.st_size}\0{est.st_mtime_ns}\n".encode())
        own = stat_of(st)
    except OSError:
        return None
    return (own.st_dev, own.st_ino, own.st_size, own.st_mtime_ns, inside.hexdigest())


def recall(path: Location, verify: bool) -> CheckpointInfo | None:
    """What the check of ``path`` found, if it was checked (with every CRC when ``verify``) and has not changed since."""
    with _lock:
        known = _known.get(path.absolute())
    if known is None or (verify and not known.verified) or known.signature != signature(path):
        return None
    return known.info


def remember(path: Location, info: CheckpointInfo, verified: bool, before: Signature | None) -> None:
    """Record that ``path`` passed its check (``verified``: every CRC); ``before`` is its signature when the check
    began: a checkpoint that changed meanwhile is not remembered."""
    if before is None or before != signature(path):
        return
    with _lock:
        _known[path.absolute()] = _Known(before, info, verified)
        if len(_known) > _MAX_KNOWN:
            for key in list(_known)[: len(_known) // 2]:
                _known.pop(key, None)


def forget(path: Location) -> None:
    """Forget ``path`` (rotation deleted it)."""
    with _lock:
        _known.pop(path.absolute(), None)
