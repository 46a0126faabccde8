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
- A child created with ``fork`` while the lock is held (a DataLoader worker forked by rank 0) would share the
  open file description, and keep the lock after its parent died: every forked child closes its copy at once
  (``os.register_at_fork``), so the lock dies with the process that took it. A descriptor passed on some other way
  (``subprocess``'s ``pass_fds``) still holds it: a refusal then names the live processes that hold the file open.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import time
import weakref
from pathlib import Path
from typing import Final

from .._core.errors import CheckpointWriteError

__all__ = ["LOCK_NAME", "FolderLock", "remove_new_folder"]

LOCK_NAME: Final = ".dist_resume.lock"
_NOFOLLOW: Final = getattr(os, "O_NOFOLLOW", 0)


_HELD: weakref.WeakSet[FolderLock] = weakref.WeakSet()  # the locks this process holds


def _close_in_child() -> None:
    """In a forked child: close every lock descriptor inherited from the parent (the parent keeps the lock)."""
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_in_child)


def _open_by(path: Path) -> list[str]:
    """The live processes of this host that hold ``path`` open, as ``pid N (command)`` (from ``/proc``; best effort)."""
    try:
        target = os.stat(path)
    except OSError:
        return []
    found = []
    for entry in os.scandir("/proc") if os.path.isdir("/proc") else ():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry.name}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry.name}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                found.append(f"pid {entry.name} ({_command(entry.name)})")
                break
    return found


def _command(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(200).split(b"\0")
    except OSError:
        return "?"
    return " ".join(w.decode("utf-8", "replace") for w in words if w)[:80] or "?"


def _alive(pid: str) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):
        return True  # another user's process, or a pid we cannot read: say nothing of it
    return True


def _holder(fd: int, path: Path) -> str:
    """Who holds the lock: as the holder wrote it into the file, checked against the live processes (best effort)."""
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
    here = host == socket.gethostname()
    mine = here and pid == str(os.getpid())
    who = f"host {host}, pid {pid}{since}"
    if mine:
        return f"another CheckpointManager in this very process ({who}): reuse that manager, or close() it first"
    if here and not _alive(pid):
        holders = _open_by(path)
        live = ", ".join(holders) if holders else "a process this user cannot see"
        return (
            f"{live}: the lock was taken by {who}, which has exited, and a process that inherited its lock file "
            "still holds it; stop that process (a leftover worker of the old job?)"
        )
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
            holder = _holder(fd, self.path)
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
        _HELD.add(self)

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
        _HELD.discard(self)
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # no holder named once released
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the only descriptor releases the flock


def remove_new_folder(folder: Path) -> bool:
    """Undo a first run's folder after a failure: delete ``folder``'s lock file, then ``folder``, when it holds
    nothing else; whether it was removed. Local.

    Call it while this process still holds the lock of ``folder`` (it created the folder to take the lock and
    nothing was saved): the lock file is unlinked first, so a process that opens it afterwards creates a new one,
    and the held descriptor is released as usual. A folder holding anything but the lock file is left as it is.
    """
    try:
        if [entry.name for entry in os.scandir(folder)] != [LOCK_NAME]:
            return False
        os.unlink(folder / LOCK_NAME)
        os.rmdir(folder)
    except OSError:
        return False  # another process wrote into it meanwhile, or it is gone: leave what is there
    return True
