"""Where a conversion writes: path checks, its locked temporary file, and the atomic replace.

Nothing here writes or deletes through a symlink: DST that is a symlink is replaced (or moved aside)
as a name, and a symlink at a temporary name is removed as a link.
"""

from __future__ import annotations

import fcntl
import glob
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointWriteError, UsageError
from .._format.atomic import TEMP_NAME, atomic_write, commit_folder, make_temp_folder, remove_path

__all__ = ["check_paths", "remove_stale_temps", "temp_path", "write_locked", "replace_folder"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def check_paths(src: Path, dst: Path, force: bool, *, folder: bool = False) -> None:
    """Refuse a path that cannot be resolved (a symlink loop), SRC == DST, a folder where a file is wanted, and an
    existing DST without ``force``."""
    same = _resolved(src, "SRC") == _resolved(dst, "DST") or (
        dst.exists() and src.exists() and os.path.samefile(src, dst)
    )
    if same:
        raise UsageError(
            f"SRC and DST are the same {'folder' if src.is_dir() else 'file'} ({str(src)!r})",
            "write to a new file, then replace the old one yourself once you have checked it",
        )
    if dst.is_dir() and not folder:
        raise UsageError(f"DST {str(dst)!r} is a folder", "give the output file's full name, e.g. DST/model.pt")
    if dst.exists() and not dst.is_dir() and folder:
        raise UsageError(f"DST {str(dst)!r} is a file", "a DCP checkpoint is a folder: give a folder name")
    if dst.exists() and not force:
        raise UsageError(f"DST {str(dst)!r} already exists", "pass --force to replace it")


def _resolved(path: Path, what: str) -> Path:
    """``path.resolve()``; a path that cannot be resolved (a symlink that points to itself, or into a loop of links:
    RuntimeError before Python 3.13, OSError from then on) is a :class:`UsageError` naming it."""
    try:
        return path.resolve()
    except (OSError, RuntimeError) as err:
        raise UsageError(
            f"{what} {str(path)!r} cannot be resolved ({type(err).__name__}: {err}): a symlink that points to itself "
            "or into a loop of links",
            f"remove or fix the link, or give the {'checkpoint' if what == 'SRC' else 'output'} by another path",
        ) from err


def _temps(dst: Path) -> Iterator[Path]:
    """The temporary files atomic_write may have left for ``dst`` (``.<name>.<16 hex>.tmp``)."""
    for tmp in dst.parent.glob(f".{glob.escape(dst.name)}.*.tmp"):
        match = TEMP_NAME.match(tmp.name)
        if match and match.group("dest") == dst.name:
            yield tmp


def remove_stale_temps(dst: Path) -> list[Path]:
    """Delete temp files a killed conversion to ``dst`` left behind; return them.

    A live conversion holds an exclusive ``flock`` on its temp file for its whole life, and the
    kernel drops it when the process dies, even by SIGKILL: a temp file whose lock can be taken
    belongs to no one.
    """
    removed = []
    for tmp in _temps(dst):
        if tmp.is_symlink():  # never ours (we create files and folders): remove the link, never follow it
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
            continue
        try:
            fd = os.open(tmp, os.O_RDONLY | _NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a conversion is writing it right now
        finally:
            os.close(fd)
        remove_path(tmp)
        removed.append(tmp)
    return removed


def temp_path(dst: Path, fd: int) -> Path:
    """The temporary file behind ``fd`` that atomic_write is writing for ``dst``."""
    st = os.fstat(fd)
    for tmp in _temps(dst):
        try:
            if os.path.samestat(tmp.lstat(), st):
                return tmp
        except OSError:
            continue
    raise CheckpointWriteError(f"the temporary file for {str(dst)!r} disappeared while it was written")


def write_locked(dst: Path, fill: Callable[[int, Path], int]) -> int:
    """Write ``dst`` atomically; ``fill(fd, temp_path)`` writes the temp file and returns its size.

    The temp file is ``flock``-ed for its whole life, so :func:`remove_stale_temps` leaves it alone.
    """
    written = 0

    def write(f: Any) -> None:
        nonlocal written
        fd = f.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)  # marks the temp file as live for remove_stale_temps
        written = fill(fd, temp_path(dst, fd))

    if dst.parent.is_dir():
        remove_stale_temps(dst)
    atomic_write(dst, write)
    return written


def replace_folder(dst: Path, fill: Callable[[Path], None]) -> None:
    """Write the folder ``dst`` through a temporary folder next to it, then rename it into place.

    An existing ``dst`` (the caller checked ``force``) is moved aside first and deleted after the rename;
    a ``dst`` that is a symlink is moved and deleted as a link, and the folder it points to is never touched.
    """
    tmp = make_temp_folder(dst)
    try:
        fill(tmp)
        commit_folder(tmp, dst)
    except OSError as err:
        raise CheckpointWriteError(f"writing {str(dst)!r} failed ({err.strerror or err}); DST is untouched") from err
    finally:
        remove_path(tmp)
