"""This process's newest snapshot of a folder, and the commit that makes a written one count: before ``snapshot()``
returns for a small state, in the background for a larger one (its CRC-32s take about 0.4 s per GiB); the next call
that needs it waits for it and gets its error.

The background commits run on one thread per process, started at the first and kept (a new thread per snapshot costs
the call the time the new thread takes to be scheduled, milliseconds on a busy machine): handing it a commit is a
queue's ``put``. It is a daemon: the calls that need a commit finished (the next snapshot, ``save``, ``close``, the
exit and SIGTERM handlers) wait for it themselves.
"""

from __future__ import annotations

import queue
import threading
from typing import Final

from ..._core.errors import CheckpointWriteError
from ..._core.location import Location
from ..._core.log import logger, shown_path
from ..._shm import PendingSnapshot, Snapshot

__all__ = ["COMMIT_INLINE_BYTES", "Commits"]

COMMIT_INLINE_BYTES: Final = 1 << 20
"""A snapshot up to this size is committed before ``snapshot()`` returns (its CRC-32s take well under a millisecond);
a larger one in the background (about 0.4 ms per MiB here: more than the copy it follows)."""

_Job = tuple["Commits", PendingSnapshot, threading.Event]
_jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _run() -> None:
    while True:
        commits, pending, done = _jobs.get()
        threading.current_thread().name = f"dist_resume-commit-{pending.step}"
        try:
            snapshot = pending.commit()
        except BaseException as err:
            commits.failed(err)
        else:
            with commits.lock:
                commits.newest = snapshot
        finally:
            done.set()


def _submit(job: _Job) -> None:
    global _worker
    with _worker_lock:
        if _worker is None or not _worker.is_alive():  # the first commit of this process (or of a fork)
            _worker = threading.Thread(target=_run, name="dist_resume-commit", daemon=True)
            _worker.start()
    _jobs.put(job)


class Commits:
    """The newest snapshot this process committed (``newest``; the node's writer's, or an FSDP2 rank's own), and the
    one being committed in the background (its step ``committing``, its end :meth:`wait`-able). Local."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self.newest: Snapshot | None = None
        self.committing: int | None = None
        self._done: threading.Event | None = None
        self._error: BaseException | None = None
        self.lock = threading.Lock()  # guards ``newest`` against the commit and copy threads

    def later(self, pending: PendingSnapshot) -> None:
        """Commit ``pending`` now when it is small, else in the background (its error at the next :meth:`join`)."""
        if pending.size <= COMMIT_INLINE_BYTES:
            self.newest = pending.commit()
            return
        done = threading.Event()
        self.committing, self._done = pending.step, done
        _submit((self, pending, done))

    def failed(self, error: BaseException) -> None:
        """The background commit's ``error``, kept for :meth:`join`."""
        self._error = error

    def wait(self) -> None:
        """Wait for the commit under way, if any (from any thread); its error is :meth:`join`'s."""
        done = self._done
        if done is not None:
            done.wait()

    def join(self, *, raising: bool) -> None:
        """Wait for the snapshot being committed; its error is raised (``raising``) or logged once."""
        done = self._done
        if done is not None:
            done.wait()
            self._done = self.committing = None
        error, self._error = self._error, None
        if error is None:
            return
        if raising:
            raise CheckpointWriteError(f"committing a snapshot of {str(self.folder)!r} failed: {error}") from error
        logger.warning("committing a snapshot of %s failed: %s", shown_path(self.folder), error)

    def marked(self, snapshot: Snapshot | None, seq: int) -> None:
        """``snapshot`` (its record marked copied into the folder) becomes the newest if the newest is still the one of
        commit number ``seq``."""
        with self.lock:
            if snapshot is not None and self.newest is not None and self.newest.seq == seq:
                self.newest = snapshot
