"""Opening a checkpoint's files without trusting the folder: no FIFO, socket or device node, no link out of it.

A checkpoint folder is data someone else may have written: a FIFO where ``manifest.json`` should be blocks a plain
``open`` for ever, a device node reads without end, and a symlink makes the reader restore another run's file. Every
file of a checkpoint folder is therefore opened here, by name inside its folder: :func:`entry_of` looks at the entry
without following a link (``lstat``), :func:`open_in_folder` refuses anything but a regular file, then opens it with
``O_NONBLOCK | O_NOFOLLOW`` (never blocks, never follows a link swapped in meanwhile) and checks the descriptor's own
type with ``fstat`` before a byte is read. :func:`open_checkpoint_file` does the same for a file the user names,
whose links are the user's own and are followed. On an object store (a :class:`~dist_resume._core.location.RemotePath`)
there are no links, FIFOs or devices: an entry is an object or a prefix, and an object opens as a
:class:`~dist_resume._store.ranges.RangeFile`, read by ranges.

Torch-free: this module imports nothing but the standard library, the error classes and the store layer.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Final, cast

from .._core.errors import CheckpointCorruptError, CheckpointError, CheckpointNotFoundError, NotACheckpointError
from .._core.location import Location, RemotePath
from .._store.ranges import RangeFile

__all__ = [
    "FolderEntry",
    "kind_of",
    "check_name",
    "entry_of",
    "folder_entries",
    "open_in_folder",
    "read_in_folder",
    "open_checkpoint_file",
    "vanished",
    "reading",
    "still_there",
]

_NO_FOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)
_NON_BLOCK: Final = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC: Final = getattr(os, "O_CLOEXEC", 0)
_KINDS: Final = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISREG, "a regular file"),
)
MAX_NAME: Final = 255  # bytes in one file name on every filesystem a checkpoint lives on
_OBJECT_WINDOW: Final = 256 << 10  # what one request reads ahead in an object opened here (small files, headers)


def kind_of(mode: int) -> str:
    """What an ``st_mode`` is, in words: ``"a FIFO (named pipe)"``, ``"a regular file"``, ..."""
    return next((words for test, words in _KINDS if test(mode)), f"a special file (mode {mode:o})")


def check_name(name: str) -> str | None:
    """Why ``name`` cannot be a file directly inside a folder (None when it can): empty, ``.``/``..``, a NUL, a
    path separator, over 255 bytes or not encodable. Local."""
    if not isinstance(name, str) or name in ("", ".", ".."):
        return f"{name!r} is not a file name"
    if "\0" in name or "/" in name or "\\" in name:
        return f"{name!r} holds a NUL or a path separator"
    try:
        encoded = os.fsencode(name)
    except UnicodeError:
        return f"{name!r} cannot be a file name here"
    return f"{name[:40]!r}... is longer than {MAX_NAME} bytes" if len(encoded) > MAX_NAME else None


@dataclass(frozen=True, slots=True)
class FolderEntry:
    """One entry of a folder as ``lstat`` sees it (a link is itself, never its target)."""

    name: str
    mode: int
    size: int
    inode: int
    mtime_ns: int

    @property
    def regular(self) -> bool:
        return stat.S_ISREG(self.mode)

    @property
    def kind(self) -> str:
        return kind_of(self.mode)

    def why_not_file(self, folder: Location) -> str | None:
        """Why this entry cannot be read as one of the checkpoint's files, naming a link's target; None for a
        regular file."""
        if self.regular:
            return None
        if stat.S_ISLNK(self.mode):
            try:
                target = os.readlink(folder / self.name) if isinstance(folder, Path) else "?"
            except OSError:
                target = "?"
            return f"is a symbolic link (to {target!r}): a checkpoint's files are read only inside its folder"
        return f"is {self.kind}, not a regular file"


def entry_of(folder: Location, name: str) -> FolderEntry:
    """``name`` inside ``folder`` as ``lstat`` sees it. ``FileNotFoundError`` when it is not there. Local."""
    st = (folder / name).stat() if isinstance(folder, RemotePath) else os.lstat(folder / name)
    return FolderEntry(name, st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns)


def folder_entries(folder: Location) -> list[FolderEntry]:
    """Every entry of ``folder`` (links not followed), by name; an entry that vanishes meanwhile is left out."""
    if isinstance(folder, RemotePath):
        listed = [(p.name, p.stat()) for p in folder.iterdir()]
        return sorted(
            (FolderEntry(n, st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns) for n, st in listed),
            key=lambda e: e.name,
        )
    found = []
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            found.append(FolderEntry(entry.name, st.st_mode, st.st_size, st.st_ino, st.st_mtime_ns))
    return sorted(found, key=lambda e: e.name)


def _refused(folder: Location, name: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{str(folder / name)!r} {why}; the checkpoint folder {str(folder)!r} was changed after it was written: "
        "resume from an earlier checkpoint, or copy the folder again (without links)"
    )


def open_in_folder(folder: Location, name: str) -> BinaryIO:
    """``name`` inside ``folder`` opened for reading, refused unless it is a regular file there. Local.

    A link, FIFO, socket, device node or folder raises :class:`CheckpointCorruptError` naming it (a link with its
    target), without opening it for reading; a missing file :class:`CheckpointNotFoundError`.
    """
    bad_name = check_name(name)
    if bad_name is not None:
        raise CheckpointCorruptError(f"checkpoint folder {str(folder)!r} names a file {bad_name}")
    if isinstance(folder, RemotePath):
        return _object(folder / name)
    try:
        why = entry_of(folder, name).why_not_file(folder)
        if why is not None:
            raise _refused(folder, name, why)
        fd = os.open(folder / name, os.O_RDONLY | _NON_BLOCK | _NO_FOLLOW | _CLOEXEC)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"{str(folder / name)!r} is not there (removed meanwhile?)") from err
    except CheckpointCorruptError:
        raise
    except OSError as err:  # ELOOP: a link swapped in after the lstat
        raise _refused(folder, name, f"cannot be opened ({err.strerror or err})") from err
    return _checked(fd, lambda why: _refused(folder, name, why))


def read_in_folder(folder: Location, name: str, limit: int) -> bytes:
    """The bytes of ``name`` inside ``folder`` (as :func:`open_in_folder` opens it), at most ``limit`` of them: a
    file over ``limit`` bytes raises :class:`CheckpointCorruptError`. Local."""
    with open_in_folder(folder, name) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointCorruptError(
            f"{str(folder / name)!r} is larger than {limit} bytes, more than this file ever holds; the checkpoint "
            "folder is damaged: resume from an earlier checkpoint"
        )
    return data


def _object(path: RemotePath) -> BinaryIO:
    """An object opened by ranges; ``CheckpointNotFoundError`` when it is not there (or is a prefix)."""
    try:
        if path.is_dir():
            raise _refused(path.parent, path.name, "is a folder (a prefix of objects), not a file")
        return cast(BinaryIO, RangeFile(path, window=_OBJECT_WINDOW))
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"{str(path)!r} is not there (removed meanwhile?)") from err


def open_checkpoint_file(path: Location) -> BinaryIO:
    """A checkpoint file the caller named, opened for reading; a link is followed (the caller's own path), anything
    but a regular file raises :class:`NotACheckpointError` without being opened for reading. Local. An object on a
    store opens by ranges. A file that is not there raises :class:`CheckpointNotFoundError` (:func:`vanished`), a
    ``FileNotFoundError``; a ``PermissionError`` is the caller's to word."""
    with reading(path):
        if isinstance(path, RemotePath):
            return cast(BinaryIO, RangeFile(path, window=_OBJECT_WINDOW))
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise _not_a_file(path, kind_of(st.st_mode))
        fd = os.open(path, os.O_RDONLY | _NON_BLOCK | _CLOEXEC)
    return _checked(fd, lambda why: _not_a_file(path, why))


def vanished(path: Location, err: FileNotFoundError | None = None) -> CheckpointNotFoundError:
    """The error for a checkpoint that is not there when it is read, after it was chosen or checked: a writer's
    rotation (``keep_last``) removes older checkpoints as it saves. ``err``: the ``FileNotFoundError`` met, when it
    named a file inside the checkpoint rather than the checkpoint itself."""
    inner = getattr(err, "filename", None)
    part = f" ({str(inner)!r} in it)" if inner is not None and os.fspath(inner) != os.fspath(str(path)) else ""
    return CheckpointNotFoundError(
        f"checkpoint {str(path)!r}{part} is not there: it was removed while it was read, or after it was chosen (a "
        "writer's rotation, keep_last, deletes older checkpoints as it saves); choose again (latest_checkpoint, or "
        "pass the folder to resume())"
    )


@contextlib.contextmanager
def reading(path: Location) -> Iterator[None]:
    """Reading the checkpoint ``path``: a ``FileNotFoundError`` raised inside (the file, or a file of the folder,
    removed meanwhile), or any other failure after which ``path`` is gone (a sharded folder renamed aside by a
    rotation reads as files missing from it), comes out as :func:`vanished`'s :class:`CheckpointNotFoundError`, also
    a ``FileNotFoundError``, never as damage. Local; nests."""
    try:
        yield
    except CheckpointNotFoundError:
        raise
    except FileNotFoundError as err:
        raise vanished(path, err) from err
    except (CheckpointError, OSError) as err:
        if still_there(path):
            raise
        raise vanished(path) from err


def still_there(path: Location) -> bool:
    """Whether ``path`` is there (a link counts; a store that cannot answer: True, the failure stands). Local."""
    try:
        return path.exists() if isinstance(path, RemotePath) else os.path.lexists(path)
    except OSError:  # a store that cannot answer now: the failure stands as it was
        return True


def _not_a_file(path: Path, why: str) -> NotACheckpointError:
    if not why.startswith("is "):
        why = f"is {why}, not a regular file"
    return NotACheckpointError(f"{str(path)!r} {why}: not a checkpoint file; point to a file torch.save wrote")


def _checked(fd: int, refuse: Callable[[str], Exception]) -> BinaryIO:
    """The descriptor as a binary file once ``fstat`` says it is a regular file (the entry may have changed between
    the ``lstat`` and the open); closed and refused otherwise."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise refuse(f"is {kind_of(st.st_mode)}, not a regular file")
        if _NON_BLOCK:
            os.set_blocking(fd, True)  # a regular file reads the same either way; plain reads from here on
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
