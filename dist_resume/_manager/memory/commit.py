"""This process's newest snapshot of a folder, and the commit that makes a written one count: before ``snapshot()``
returns for a small state, in a background thread for a larger one (its CRC-32s take about 0.5 s per GiB); the next
call that needs it waits for it and gets its error."""

from __future__ import annotations

import threading
from typing import Final

from ..._core.errors import CheckpointWriteError
from ..._core.location import Location
from ..._core.log import logger, shown_path
from ..._memory import PendingSnapshot, Snapshot

__all__ = ["COMMIT_INLINE_BYTES", "Commits"]

COMMIT_INLINE_BYTES: Final = 32 << 20
"""A snapshot up to this size is committed before ``snapshot()`` returns (its CRC-32s take a few milliseconds); a
larger one in a background thread."""


class Commits:
    """The newest snapshot this process committed (``newest``; the node's writer's, or an FSDP2 rank's own), and the
    one being committed in the background (``thread``, its step ``committing``). Local."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self.newest: Snapshot | None = None
        self.thread: threading.Thread | None = None
        self.committing: int | None = None
        self._error: BaseException | None = None
        self.lock = threading.Lock()  # guards ``newest`` against the commit and copy threads

    def later(self, pending: PendingSnapshot) -> None:
        """Commit ``pending`` now when it is small, else in a background thread (its error at the next :meth:`join`)."""
        if pending.size <= COMMIT_INLINE_BYTES:
            self.newest = pending.commit()
            return

        def run() -> None:
            try:
                snapshot = pending.commit()
            except BaseException as err:
                self._error = err
                return
            with self.lock:
                self.newest = snapshot

        self.committing = pending.step
        self.thread = threading.Thread(target=run, name=f"dist_resume-commit-{pending.step}", daemon=False)
        self.thread.start()

    def join(self, *, raising: bool) -> None:
        """Wait for the snapshot being committed; its error is raised (``raising``) or logged once."""
        thread = self.thread
        if thread is not None:
            thread.join()
            self.thread = self.committing = None
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
