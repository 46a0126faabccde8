"""A checkpoint folder's identity: the history its snapshots belong to.

Shared memory outlives a folder: after a SIGKILL, a user who deletes the folder (``rm -rf``) and relaunches, or another
run that makes a folder at the same path, would otherwise resume the old run's snapshots, which the store finds by the
folder's path alone. So the folder keeps a random identity in :data:`IDENTITY_NAME` (made by the manager's writer, under
the folder's write lock, at its first snapshot), every commit record carries it, and a snapshot counts only while its
record's identity is the folder's: a folder deleted and recreated, or another run's, has another one (or none), and the
old snapshots are stale. Torch-free.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Any, Final

from .._core.location import Location, RemotePath
from .._format.atomic import atomic_write

__all__ = ["IDENTITY_NAME", "IDENTITY", "read_identity", "make_identity"]

IDENTITY_NAME: Final = ".dist_resume.id"
"""The file in a checkpoint folder that holds its identity: 32 hexadecimal digits and a newline."""

IDENTITY: Final = re.compile(r"^[0-9a-f]{32}$")
"""What an identity is."""

_MAX_BYTES: Final = 64
_OPEN_FLAGS: Final = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK


def _read(path: Location) -> bytes:
    if isinstance(path, RemotePath):
        return path.read_bytes()[: _MAX_BYTES + 1]
    fd = os.open(path, _OPEN_FLAGS)  # never through a symlink, never blocking on a FIFO
    try:
        return os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)


def read_identity(folder: Location) -> str | None:
    """The identity ``folder`` keeps, or None: no such file (a folder that never held a snapshot, or none at all), or
    one that does not hold an identity (damaged: no snapshot can belong to it). Local; never raises.

    Example::

        >>> read_identity(Path("ckpts")) is None or len(read_identity(Path("ckpts"))) == 32
        True
    """
    try:
        text = _read(folder / IDENTITY_NAME).decode("ascii").strip()
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return text if IDENTITY.match(text) else None


def make_identity(folder: Location) -> str:
    """``folder``'s identity, made when it has none (a new random one, written atomically: a damaged one is replaced,
    and the snapshots that named it are stale). Local; the caller holds the folder's write lock. Raises
    :class:`~dist_resume.errors.CheckpointWriteError` when it cannot be written.

    Example::

        >>> make_identity(Path("ckpts")) == make_identity(Path("ckpts"))
        True
    """
    found = read_identity(folder)
    if found is not None:
        return found
    if isinstance(folder, Path):
        folder.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)

    def write(f: Any) -> None:
        f.write(f"{token}\n".encode("ascii"))

    atomic_write(folder / IDENTITY_NAME, write)
    return token
