"""Where a checkpoint folder's snapshots live: one directory per folder under the node's shared memory, owned by us.

The root is ``/dev/shm`` (a tmpfs: FACTS 39-40) unless :data:`SHM_DIR_ENV` names another directory. A folder's
directory is ``dist_resume-<uid>-<16 hex>``: the hex digits are the start of the SHA-256 of the folder's key
(:func:`folder_key`: a local folder's resolved path, a store's URL), so another folder never shares it, and the uid
keeps users apart. The commit records carry the key too, so a hash collision is caught on read (and the folder's
identity, :mod:`.identity`, so a folder made again at the same path is told from the old one).

That name is predictable, and ``/dev/shm`` is writable by every user: another user who makes it first (a directory,
a symlink, a file) would stop every snapshot of this folder. So when it is taken by something this user does not
own, the store is ``<that name>.<16 random hex>`` beside it instead (made with ``O_EXCL`` semantics, mode 0700: a
name nobody can take first), found again after a restart by listing the root for this user's own directories of that
prefix (another user's of the same prefix are never taken); one WARNING says so.

Nothing here is read unless this user owns it: a directory or file that is a symlink, is owned by another uid, or
(a directory) is writable by others is refused. Torch-free.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Final

from .._core.errors import CheckpointWriteError, UsageError
from .._core.location import Location

__all__ = [
    "SHM_DIR_ENV",
    "PART",
    "folder_key",
    "shm_root",
    "required_root",
    "store_dir",
    "owned_store",
    "make_store",
    "open_owned",
    "check_part",
]

SHM_DIR_ENV: Final = "DIST_RESUME_SHM_DIR"
"""The environment variable naming the directory that holds snapshots instead of ``/dev/shm`` (tests, or a larger
tmpfs mounted elsewhere)."""

_DEFAULT_ROOT: Final = Path("/dev/shm")
PART: Final = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
"""What a snapshot's part may be called (``state``, ``rank3``, ``shard-0``): it is part of its files' names."""
_FALLBACK: Final = re.compile(r"^[0-9a-f]{16}$")

# the library logger (dist_resume._core.log imports torch; listing snapshots stays torch-free)
logger = logging.getLogger("dist_resume")

_OPEN_FLAGS: Final = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK


def folder_key(folder: Location) -> str:
    """The identity of a checkpoint folder: its resolved absolute path, or its URL on a store. Local."""
    return str(folder.resolve())


def check_part(part: str) -> str:
    """``part`` when it is a valid part name (:data:`PART`); :class:`UsageError` otherwise."""
    if not isinstance(part, str) or PART.match(part) is None:
        raise UsageError(
            f"snapshot part {part!r} is not a valid name",
            hint="use 1-64 lowercase letters, digits, '_' or '-', starting with a letter or digit (e.g. 'rank3')",
        )
    return part


def shm_root() -> Path | None:
    """The directory holding every folder's snapshots: :data:`SHM_DIR_ENV`, else ``/dev/shm``; None without either.

    A :data:`SHM_DIR_ENV` that is not a directory is a :class:`UsageError` (it was asked for). Local."""
    named = os.environ.get(SHM_DIR_ENV, "")
    if named:
        root = Path(named)
        if not root.is_dir():
            raise UsageError(
                f"{SHM_DIR_ENV}={named!r} is not a directory",
                hint=f"create it (a tmpfs: memory, not disk) or unset {SHM_DIR_ENV} to use /dev/shm",
            )
        return root
    return _DEFAULT_ROOT if _DEFAULT_ROOT.is_dir() else None


def required_root() -> Path:
    """:func:`shm_root`, or a :class:`UsageError` saying snapshots need Linux shared memory. Local."""
    root = shm_root()
    if root is None:
        raise UsageError(
            "snapshots need Linux shared memory (/dev/shm), and this machine has none",
            hint=f"save to the folder instead (CheckpointManager.save), or set {SHM_DIR_ENV} to a RAM-backed directory",
        )
    return root


def store_dir(folder: Location) -> Path | None:
    """The directory that holds ``folder``'s snapshots (it may not exist yet): its name, or this user's directory
    beside it when another user holds the name; None without shared memory. Local."""
    root = shm_root()
    return None if root is None else _resolved(_named(root, folder))


def _taken(path: Path) -> str | None:
    """Why ``path`` cannot be this user's store (another user's, a symlink, not a directory), or None (it is, or it
    does not exist)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return err.strerror or str(err)
    return _refusal(st, directory=True)


def _fallbacks(primary: Path) -> list[Path]:
    """This user's own stores beside ``primary`` (``<name>.<16 hex>``), the most recently changed first."""
    prefix = f"{primary.name}."
    found: list[tuple[float, Path]] = []
    try:
        entries = list(os.scandir(primary.parent))
    except OSError:
        return []
    for entry in entries:
        if not entry.name.startswith(prefix) or _FALLBACK.match(entry.name[len(prefix) :]) is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if _refusal(st, directory=True) is None:
            found.append((st.st_mtime, Path(entry.path)))
    return [path for _, path in sorted(found, key=lambda f: -f[0])]


def _resolved(primary: Path) -> Path:
    """``primary`` when it is this user's; else this user's store beside it, if there is one (kept when another user
    took the name, and still found once that one is gone); else ``primary``."""
    if _taken(primary) is None and os.path.lexists(primary):
        return primary
    found = _fallbacks(primary)
    return found[0] if found else primary


def _named(root: Path, folder: Location) -> Path:
    digest = hashlib.sha256(folder_key(folder).encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return root / f"dist_resume-{os.getuid()}-{digest}"


def _refusal(st: os.stat_result, *, directory: bool) -> str | None:
    """Why an entry with this ``lstat`` may not be used, or None."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if directory and not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if directory and st.st_mode & 0o022:
        return f"others may write into it (mode {stat.S_IMODE(st.st_mode):o})"
    if not directory and not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    return None


def owned_store(store: Path) -> bool:
    """Whether ``store`` is a directory this user owns and may read (not a symlink, not writable by others).

    False, silently, when it does not exist; False with one WARNING when it exists and is refused."""
    try:
        st = os.lstat(store)
    except FileNotFoundError:
        return False
    except OSError as err:
        logger.warning("ignoring the snapshots in %s: %s", store, err.strerror or err)
        return False
    why = _refusal(st, directory=True)
    if why is not None:
        logger.warning("ignoring the snapshots in %s: %s; remove it if it is not yours to keep", store, why)
        return False
    return True


def make_store(folder: Location) -> Path:
    """``folder``'s snapshot directory (:func:`store_dir`), created (mode 0o700) when missing: beside its name, with one
    WARNING, when another user holds that (see the module). Local.

    :class:`UsageError` without shared memory; :class:`CheckpointWriteError` when it cannot be created."""
    primary = _named(required_root(), folder)
    store = _resolved(primary)
    if store != primary:
        return store
    taken = _taken(primary)
    if taken is None:
        _created(primary)
        taken = _taken(primary)  # another user may have made it between the look and the mkdir
        if taken is None:
            return primary
    store = _created(primary.with_name(f"{primary.name}.{secrets.token_hex(8)}"))
    logger.warning(
        "the snapshot directory %s is not this user's (%s): another user took its name; snapshots of %s go into %s "
        "instead, found again after a restart",
        primary,
        taken,
        folder,
        store,
    )
    return store


def _created(store: Path) -> Path:
    try:
        os.mkdir(store, 0o700)
    except FileExistsError:
        pass
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot create the snapshot directory {str(store)!r}: {err.strerror or err}; "
            f"check the permissions of {str(store.parent)!r} or set {SHM_DIR_ENV} to a writable tmpfs directory"
        ) from err
    return store


def open_owned(path: Path) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file ``path`` and its ``fstat``, when this user owns it.

    Never follows a symlink, never blocks on a FIFO. Raises ``OSError`` (the file is gone) or :class:`PermissionError`
    with the reason it is refused; the caller closes the descriptor."""
    fd = os.open(path, _OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        why = _refusal(st, directory=False)
        if why is not None:
            raise PermissionError(f"{path}: {why}")
    except BaseException:
        os.close(fd)
        raise
    return fd, st
