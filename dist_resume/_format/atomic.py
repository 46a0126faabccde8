"""Atomic file replacement: a temporary file in the same folder, fsync, ``os.replace``, fsync of the folder."""

from __future__ import annotations

import errno
import os
import pickle
import re
import secrets
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointWriteError
from .._core.location import Location, RemotePath
from .._store.upload import upload

__all__ = [
    "TEMP_NAME",
    "atomic_write",
    "create_temp",
    "commit_file",
    "discard_temp",
    "write_error",
    "not_pickled",
    "fsync_dir",
    "remove_path",
    "make_temp_folder",
    "commit_folder",
]


def fsync_dir(folder: Path) -> None:
    """fsync a folder, so that the names created or renamed in it survive a power loss. Local."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_path(path: Location) -> None:
    """Delete a file or a whole folder tree; a symlink goes as a link. Local.

    ``shutil.rmtree`` never follows a symlink inside the tree (it unlinks it), so nothing outside ``path``
    is touched. A path that is already gone is fine. On a store: the object, or every object under the prefix."""
    if isinstance(path, RemotePath):
        path.remove_tree()
    elif path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


TEMP_NAME = re.compile(r"^\.(?P<dest>.+)\.(?P<token>[0-9a-f]{16})\.tmp$")
"""The names :func:`atomic_write` gives its temporary files: ``.<dest name>.<16 hex digits>.tmp``."""

_WRITE_ERRORS = {
    errno.ENOSPC: ("the disk is full", "free space or save to a larger disk"),
    errno.EDQUOT: ("the disk quota is exceeded", "free space within your quota"),
    errno.EFBIG: (
        "the file grew past the file-size limit (`ulimit -f`, RLIMIT_FSIZE) or the filesystem's maximum file size",
        "raise the limit (`ulimit -f unlimited`) or save to a filesystem that allows files this large",
    ),
    errno.EACCES: ("permission denied", "fix the folder's permissions"),
    errno.EPERM: ("operation not permitted", "fix the folder's permissions"),
    errno.EROFS: ("the filesystem is read-only", "save to a writable folder"),
}


class _RecordingFile:
    """Remembers the OSError a write raised: torch.save replaces it with an opaque RuntimeError."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written: int = self._f.write(data)
        except OSError as err:
            self.error = err
            raise
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


# O_EXCL fails on any existing name, a symlink included (it is never followed); O_NOFOLLOW says so twice
_CREATE_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _create_temp(folder: Path, dest_name: str) -> tuple[int, Path]:
    """A new file next to the destination with the mode ``open()`` would give it (0o666 minus the umask).

    Never opens an existing name: a file or symlink planted at the temporary name is left alone and
    another name is drawn."""
    while True:
        tmp = folder / f".{dest_name}.{secrets.token_hex(8)}.tmp"
        try:
            return os.open(tmp, _CREATE_NEW, 0o666), tmp
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue


def _check_folder(dest: Path) -> Path:
    """``dest``'s folder; :class:`CheckpointWriteError` when it does not exist."""
    folder = dest.parent
    if not folder.is_dir():
        raise CheckpointWriteError(
            f"cannot save {str(dest)!r}: the folder {str(folder)!r} does not exist; create it first"
        )
    return folder


def create_temp(dest: Path) -> tuple[int, Path]:
    """The temporary file of a save of ``dest`` (:data:`TEMP_NAME`), new, open for writing: (fd, path). Local.

    Raises :class:`CheckpointWriteError` when ``dest``'s folder does not exist, ``OSError`` when it refuses the file
    (:func:`write_error` says why)."""
    return _create_temp(_check_folder(dest), dest.name)


def commit_file(tmp: Path, dest: Path) -> None:
    """Rename the finished, fsynced ``tmp`` to ``dest`` (the completion marker), then fsync their folder. Local;
    raises ``OSError``."""
    os.replace(tmp, dest)
    fsync_dir(dest.parent)


def discard_temp(tmp: Path) -> None:
    """Remove the temporary file of a failed save; one already gone, or that cannot be removed, is left. Local."""
    try:
        os.unlink(tmp)
    except OSError:
        pass


def write_error(dest: Location, err: BaseException) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` for a failed write of ``dest``: the cause (disk full, ...) and the fix."""
    if isinstance(err, OSError) and err.errno in _WRITE_ERRORS:
        what, fix = _WRITE_ERRORS[err.errno]
        what = f"{what} ({errno.errorcode[err.errno]}: {err.strerror})"
    elif isinstance(err, OSError):
        what, fix = err.strerror or str(err), "fix the cause"
    else:
        what, fix = (str(err).splitlines() or [""])[0], "fix the cause"
    left = "the upload was aborted" if isinstance(dest, RemotePath) else "no temporary file was left behind"
    return CheckpointWriteError(
        f"saving {str(dest)!r} failed: {what}; the previous checkpoint (if any) is untouched and {left}; {fix}, "
        "then save again"
    )


def not_pickled(dest: Location, err: BaseException) -> CheckpointWriteError:
    """The :class:`CheckpointWriteError` for a payload that could not be pickled into ``dest``."""
    return CheckpointWriteError(
        f"saving {str(dest)!r} failed: the state could not be pickled ({type(err).__name__}: {err}); "
        "keep lambdas, open files and other unpicklable objects out of state dicts and extra. "
        "The previous checkpoint (if any) is untouched"
    )


def _upload(dest: RemotePath, write: Callable[[Any], None]) -> RemotePath:
    """:func:`atomic_write` of an object: a streamed upload, visible only once complete (see :mod:`dist_resume._store.upload`)."""
    recorder: _RecordingFile | None = None

    def record(f: Any) -> None:
        nonlocal recorder
        recorder = _RecordingFile(f)
        write(recorder)

    try:
        upload(dest, record)
    except (pickle.PicklingError, TypeError, AttributeError) as err:
        raise not_pickled(dest, err) from err
    except Exception as err:  # the store's errors (OSError subclasses from s3fs, botocore's own), torch's RuntimeError
        cause = recorder.error if recorder is not None and recorder.error is not None else err
        raise write_error(dest, cause) from cause
    return dest


def atomic_write(path: Location, write: Callable[[Any], None]) -> Location:
    """Write ``path`` through a temporary file in the same folder, fsync it, then ``os.replace`` it in.

    Local. A reader sees the old file or the new one, never a partial one: the rename is the
    completion marker, and the folder is fsynced after it so the rename survives a power loss.
    Nothing is written through a symlink: the temporary file is always new (``O_EXCL``), and a
    ``path`` that is a symlink is replaced as a name (the file it pointed to keeps its content).
    The file gets the mode ``open()`` would give it (0o666 minus the umask). On error (disk full,
    file-size limit, permissions) the temporary file is removed and :class:`CheckpointWriteError`
    names the cause; a process killed mid-write leaves a ``.<name>.<hex>.tmp`` file
    (:data:`TEMP_NAME`) that :class:`CheckpointManager` removes on its next save.

    An object on a store (a URL) is uploaded straight to its name, streamed: the upload's last request commits it,
    so a reader sees the old object or the new one, never a partial one, and a killed upload leaves nothing visible.

    Example::

        >>> dist_resume._format.atomic.atomic_write(Path("w.pt"), lambda f: torch.save({"w": torch.ones(2)}, f))
        PosixPath('w.pt')
    """
    dest = path
    if isinstance(dest, RemotePath):
        return _upload(dest, write)
    _check_folder(dest)
    tmp_name: Path | None = None
    recorder: _RecordingFile | None = None
    try:
        fd, tmp_name = create_temp(dest)
        with os.fdopen(fd, "wb") as f:
            recorder = _RecordingFile(f)
            write(recorder)
            f.flush()
            os.fsync(f.fileno())
        commit_file(tmp_name, dest)
        tmp_name = None
    except (OSError, RuntimeError) as err:  # torch.save reports write errors as RuntimeError
        cause = recorder.error if recorder is not None and recorder.error is not None else err
        raise write_error(dest, cause) from cause
    except (pickle.PicklingError, TypeError, AttributeError) as err:  # an object torch.save cannot pickle
        raise not_pickled(dest, err) from err
    finally:
        if tmp_name is not None:
            discard_temp(tmp_name)
    return dest


def make_temp_folder(dest: Path) -> Path:
    """A new empty folder ``.<dest name>.<16 hex>.tmp`` (:data:`TEMP_NAME`) next to ``dest``. Local.

    Raises :class:`CheckpointWriteError` when ``dest``'s folder does not exist or refuses it."""
    if not dest.parent.is_dir():
        raise CheckpointWriteError(
            f"cannot save {str(dest)!r}: the folder {str(dest.parent)!r} does not exist; create it first"
        )
    while True:
        tmp = dest.parent / f".{dest.name}.{secrets.token_hex(8)}.tmp"
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:  # pragma: no cover - 64 random bits collided
            continue
        except OSError as err:
            raise write_error(dest, err) from err


def commit_folder(tmp: Path, dest: Path) -> None:
    """Rename the finished folder ``tmp`` to ``dest``, then fsync their folder. Local; raises ``OSError``.

    The rename is the completion marker (fsync ``tmp``'s files and ``tmp`` itself first). An existing
    ``dest`` (a folder, a file, or a symlink, moved as a name) is renamed aside to a :data:`TEMP_NAME` first
    and deleted after; if the rename fails it is put back. A crash between the two renames leaves ``dest``
    absent and both at temporary names, which ``CheckpointManager`` removes on its next save.
    """
    old = None
    if os.path.lexists(dest):
        old = dest.parent / f".{dest.name}.{secrets.token_hex(8)}.tmp"
        os.replace(dest, old)
    try:
        os.rename(tmp, dest)
    except OSError:
        if old is not None:
            os.replace(old, dest)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        remove_path(old)
