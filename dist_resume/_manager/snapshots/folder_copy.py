"""The copy of this process's snapshots into the checkpoint folder: no second copy from the device, the snapshot's
bytes, by rank 0 alone or striped across rank 0's node's ranks (:mod:`.striped_copy`), in a background thread whose
error the next ``snapshot``, ``save`` or ``close`` raises on every rank; rotation after it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..._core.errors import CheckpointWriteError
from ..._core.location import Location
from ..._core.log import log_rank0, logger, shown_path, shown_size
from ..._core.rank import global_rank
from ..._shm import Snapshot, mark_persisted, persist_snapshot
from ..._source.listing import numbered_checkpoints
from ..folder_save import SaveTarget
from .commit import Commits
from .striped_copy import CopyTask, call_off, copy_group, copy_striped, copy_striped_share, copying_ranks

__all__ = ["FolderCopies"]


class FolderCopies:
    """This process's copy into the folder: rank 0's thread, or this rank's share of a striped copy; rank 0's error
    until the next call raises it. The snapshot copied is ``commits``' newest."""

    def __init__(self, commits: Commits) -> None:
        self.commits = commits
        self.folder = commits.folder
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def task(self, step: int) -> CopyTask | None:
        """On rank 0: whether ``save(step)`` can copy this process's snapshot of ``step`` (committed, or being
        committed) instead of saving again, once the previous copy is done (its error raised here): the copy, with
        how many ranks make it (:func:`~.striped_copy.copying_ranks`), or None. Local."""
        self.join()
        if self.commits.committing is not None:
            held = self.commits.committing == step
        else:
            newest = self.commits.newest
            held = newest is not None and newest.step == step
        return CopyTask(step, copying_ranks(self.folder)) if held else None

    def start(self, target: SaveTarget, dest: Location, copy: CopyTask) -> None:
        """Copy the snapshot of ``copy.step`` into ``dest`` once it is committed, then rotate, in a thread; its error is
        raised at the next ``snapshot``, ``save`` or ``close``, on every rank. Collective: every rank passes rank 0's
        ``copy``. With ``copy.ranks`` > 1 (a local folder) the copy is striped (:mod:`.striped_copy`): ranks
        ``1 .. copy.ranks - 1``, rank 0's node, each copy their range of the file in a thread of their own, on a group
        made the first time by every rank; the other ranks return at once."""
        self.join(raising=False)  # this rank's previous share: two copies never share the group
        path = dest if isinstance(dest, Path) else None
        group = copy_group(copy.ranks) if copy.ranks > 1 and path is not None else None
        rank, step = global_rank(), copy.step

        def share(path: Path) -> None:
            try:
                copy_striped_share(path, group)
            except BaseException as err:  # rank 0's copy fails too: its error is every rank's at the next call
                logger.debug("rank %d's share of the snapshot copy into %s failed: %s", rank, path, err)

        def run() -> None:
            try:
                self.commits.wait()  # the snapshot's commit, when it is under way
                snapshot = self.commits.newest
                if snapshot is None or snapshot.step != step:  # its commit failed: that error comes at the next call
                    if group is not None:
                        call_off(group)
                    raise CheckpointWriteError(f"the snapshot of step {step} was not committed; nothing was copied")
                self._now(target, snapshot, dest, group)
            except BaseException as err:
                self._error = err

        if rank == 0:
            self._thread = threading.Thread(target=run, name=f"dist_resume-copy-{step}", daemon=False)
        elif group is not None and path is not None and rank < copy.ranks:
            self._thread = threading.Thread(target=share, args=(path,), name=f"dist_resume-copy-{step}", daemon=False)
        else:
            return
        self._thread.start()

    def _now(self, target: SaveTarget, snapshot: Snapshot, dest: Location, group: Any = None) -> None:
        """On rank 0: copy ``snapshot`` into ``dest`` (striped over ``group``, collective on it; or alone), mark it
        copied, say so, rotate."""
        started = time.perf_counter()
        striped = group is not None and isinstance(dest, Path) and copy_striped(snapshot, dest, group)
        if not striped:
            persist_snapshot(snapshot, dest)
        self.commits.marked(mark_persisted(snapshot), snapshot.seq)
        log_rank0(
            logging.INFO,
            "saved %s (step %d, %s, copied from shared memory%s) in %.2f s",
            shown_path(dest),
            snapshot.step,
            shown_size(snapshot.size),
            f", striped over {dist.get_world_size(group)} ranks" if striped else "",
            time.perf_counter() - started,
        )
        target.rotate(dest, snapshot.step)

    def join(self, *, raising: bool = True) -> None:
        """Wait for this process's copy into the folder (rank 0's, or this rank's share of a striped one); rank 0's
        error is raised (``raising``; else it waits for the next call). Local."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        if not raising:
            return
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointWriteError(f"copying a snapshot into {str(self.folder)!r} failed: {error}") from error

    def newest(self, target: SaveTarget, *, stripe: bool = False) -> CopyTask | None:
        """On rank 0: copy this process's newest snapshot (its commit waited for) into the folder unless it holds that
        step already. Local. ``stripe`` (for ``close()``, collective): the previous copy's error is raised here, and a
        copy that stripes (:func:`~.striped_copy.copying_ranks`) is returned, for every rank to make. Without (at an
        unplanned end, rank 0 alone) that error is logged and rank 0 copies the newest snapshot itself."""
        self.commits.join(raising=False)
        if stripe:
            self.join()
        else:
            try:
                self.join()
            except CheckpointWriteError as err:  # a striped copy whose peers are gone (a SIGTERM): rank 0 alone now
                logger.warning("%s; copying the newest snapshot again, from rank 0 alone", err)
        snapshot = self.commits.newest
        if snapshot is None or snapshot.persisted:
            return None
        newest_saved = max((s for s, _ in numbered_checkpoints(target.folder)), default=None)
        if newest_saved is not None and newest_saved >= snapshot.step:
            return None
        ranks = copying_ranks(self.folder) if stripe else 1
        if ranks > 1:
            return CopyTask(snapshot.step, ranks)
        self._now(target, snapshot, target.file(snapshot.step))
        return None
