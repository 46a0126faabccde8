"""One writer per checkpoint folder: an exclusive ``flock`` on ``<folder>/.dist_resume.lock``.

The lock belongs to an open file description, so the kernel drops it when the holder closes the
file or dies in any way (SIGKILL, OOM killer, node reboot): there is never a stale lock to clean
up by hand. The file itself stays in the folder (deleting a lock file races with a process that
has just opened it); while the lock is held it says who holds it (host, pid, since when).

Caveats, in the docstring of :class:`~dist_resume.CheckpointManager` too:

- On NFS, ``flock`` may be emulated with byte-range locks (Linux NFS clients since 2.6.12, which
  then do work across clients) or be local to one client (``local_lock=flock``/``all`` mounts,
  older clients, some FUSE filesystems): there two hosts can both "hold" it. Where that matters,
  keep one job per folder by other means too (the scheduler's job dependencies).
- A child created with ``fork`` while the lock is held (a DataLoader worker forked by rank 0)
  shares the open file description, so the lock lives until that child exits as well.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
from pathlib import Path
from typing import Final

from .._core.errors import CheckpointWriteError

__all__ = ["LOCK_NAME", "FolderLock"]

LOCK_NAME: Final = ".dist_resume.lock"
_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)


def _holder(fd: int) -> str:
    """Who holds the lock, as the holder wrote it into the file (best effort)."""
    try:
        text = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    fields = dict(part.split("=", 1) for part in text.split() if "=" in part)
    if "pid" not in fields:
        return "a process that has not written its name yet (it is taking the lock right now)"
    host, pid = fields.get("host", "?"), fields["pid"]
    since = ""
    try:
        since = ", since " + time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(fields.get("since", ""))))
    except ValueError:
        pass
    mine = host == socket.gethostname() and pid == str(os.getpid())
    who = f"host {host}, pid {pid}{since}"
    if mine:
        return f"another CheckpointManager in this very process ({who}): reuse that manager, or close() it first"
    return f"{who}: another job is saving into this folder (a relaunch while the old allocation still runs?)"


class FolderLock:
    """The exclusive, non-blocking write lock of one checkpoint folder. Local."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock (creating the folder, with its parents, on a first run), or raise
        :class:`CheckpointWriteError` naming the folder and the holder."""
        if self._fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise CheckpointWriteError(
                f"cannot create the checkpoint folder {str(self.path.parent)!r}: {err.strerror or err}; "
                "check the path and its permissions"
            ) from err
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _holder(fd)
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointWriteError(
                    f"cannot save into checkpoint folder {str(self.path.parent)!r}: it is locked by {holder}. "
                    "One writer per folder: stop the other writer or save into another folder; reading "
                    f"(resume, latest_checkpoint) needs no lock. The lock file is {str(self.path)!r}; the "
                    "lock goes away by itself when its holder exits"
                ) from err
            raise CheckpointWriteError(
                f"cannot lock checkpoint folder {str(self.path.parent)!r} ({str(self.path)!r}): "
                f"{err.strerror or err}; this filesystem may not support flock: save into a local or "
                "flock-capable folder"
            ) from err
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"host={socket.gethostname()} pid={os.getpid()} since={time.time():.0f}\n".encode(), 0)
        except OSError:
            pass  # the lock holds without the note (a full disk must not stop a save that may still fit)
        self._fd = fd

    def _open(self) -> int:
        """The lock file, opened without following a symlink, and only if it is a regular file of one link.

        Taking the lock truncates and rewrites the file: through a planted symlink (or hard link) that
        would destroy the file it points to, so anything but a plain file is refused, naming it.
        """
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | _NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
        except OSError as err:
            if err.errno == errno.ELOOP or self.path.is_symlink():
                raise self._not_plain(f"a symbolic link (to {os.readlink(self.path)!r})") from err
            raise CheckpointWriteError(
                f"cannot open the lock file {str(self.path)!r} of checkpoint folder {str(self.path.parent)!r}: "
                f"{err.strerror or err}; check the folder's permissions"
            ) from err
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            os.close(fd)
            what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links"
            raise self._not_plain(what)
        return fd

    def _not_plain(self, what: str) -> CheckpointWriteError:
        return CheckpointWriteError(
            f"cannot lock checkpoint folder {str(self.path.parent)!r}: its lock file {str(self.path)!r} is {what}, "
            "and dist_resume never writes through one (taking the lock truncates the file, which would destroy what "
            "it points to); nothing was written. Remove it (the toolkit creates a plain one) and save again"
        )

    def release(self) -> None:
        """Drop the lock (no-op if not held). Local."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # no holder named once released
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the only descriptor releases the flock
