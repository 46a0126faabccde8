"""What one manager's process knows of its folder's snapshots, and the calls that take one, commit it in the
background, copy it into the folder and free it."""

from __future__ import annotations

import time
from typing import Any

from ..._checkpoint.objects import LiveObjects
from ..._core.errors import CheckpointWriteError, DistResumeError, UsageError
from ..._core.location import Location
from ..._core.log import logger, shown_path, shown_size
from ..._core.rank import global_rank
from ..._dist.agree import first_failure
from ..._dist.comm import Outcome, all_gather_objects, collective_step, run_on_rank0
from ..._dist.env import is_distributed, rank_info
from ..._memory import (
    PendingSnapshot,
    Snapshot,
    release_mappings,
    remove_snapshots,
)
from ..._memory.place import required_root
from ..._save.async_save import wait_pending
from ..._save.save import prepare_payload
from ..._state.sharded import is_sharded
from ..folder_save import SaveTarget
from .choose import MemoryChoice
from .commit import Commits
from .exit import owner, unwatch, watch
from .folder_copy import FolderCopies
from .shards import begin_own, exit_group, held_everywhere, persist_newest, persist_own
from .split import copy_share, meet, node_group, receive, splits
from .striped_copy import CopyTask
from .write import begin_write

__all__ = ["MemoryTier"]


class MemoryTier:
    """What one manager's process knows of its folder's snapshots: the newest this process wrote (each node's local
    rank 0 writes), whether the folder holds it, and the copy into the folder running in the background (rank 0)."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self.commits = Commits(folder)  # the newest snapshot, and its commit in the background
        self.copies = FolderCopies(self.commits)  # its copy into the folder, in the background
        self.used = False  # this process snapshotted or resumed from memory: close() copies and frees
        self.copied = 0  # the tensor bytes this process copied into the last snapshot
        self.sharded = False  # FSDP2: every rank writes its own shards (.shards), no node writer
        self.live: LiveObjects | None = None  # FSDP2: the objects of the last snapshot, whose specs close() writes
        self.exit_group: Any = None  # FSDP2: the group the ranks write the newest snapshot on at an unplanned end
        self.pid = owner()  # only this process acts on the snapshots: a fork (a DataLoader's worker) never does

    @property
    def forked(self) -> bool:
        """Whether this is a child forked from the process that made the tier (which then copies, commits and
        frees nothing, and touches neither the folder nor the slots)."""
        return owner() != self.pid

    # --- snapshot ---

    def take(self, target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any) -> None:
        """The body of :meth:`CheckpointManager.snapshot`. Collective under torch.distributed. Returns once the
        snapshot's data is in shared memory; its commit (the CRC-32s, then the record) follows in a background thread
        unless it is small (:data:`~.commit.COMMIT_INLINE_BYTES`). The previous snapshot's commit is waited for first, and its
        error is this call's. Under DDP with several local ranks each copies its share (:mod:`.split`) and the node's
        ranks meet before the commit; any rank's failure is the same error on every rank, nothing committed."""
        sharded = live.model is not None and is_sharded(live.model)
        if sharded and target.full_state:
            raise UsageError(
                "CheckpointManager(full_state=True).snapshot() of an FSDP2 model: its snapshots hold each rank's own "
                "shards, which reach the folder as a sharded checkpoint, not as one full file",
                hint="drop full_state=True to snapshot (the folder then gets ckpt_<step>.dcp folders), or save() alone",
            )
        required_root()  # no shared memory (not Linux): a UsageError on every rank before anything is written
        wait_pending()

        def prepare() -> None:  # rank 0: the previous copy's error first, then the folder's write lock
            self._join_copy()
            target.prepare()

        run_on_rank0(prepare, task="prepare the snapshot")  # a second job on the folder stops here too
        started = time.perf_counter()
        build, saved_epoch = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True, everywhere=True)
        group = node_group() if splits(live.model) else None

        def payload() -> dict[str, Any]:  # the writer: the previous snapshot's commit error first
            self._join_commit(raising=True)
            return build()

        error: BaseException | None = None
        pending: PendingSnapshot | None = None
        self.copied = 0
        try:
            if sharded:  # every rank its own shards (.shards): no node writer
                pending, self.copied = begin_own(self.folder, payload, step, saved_epoch)
            elif rank_info().local_rank == 0:
                pending, self.copied = begin_write(self.folder, payload, step, saved_epoch, live.model, group)
            elif group is not None:
                plan = receive(group)
                if plan is not None:
                    self.copied = copy_share(build(), plan)
        except Exception as err:
            error = err
        if sharded:
            self._agree_then_commit(error, pending)
            self.exit_group = exit_group()  # collective the first time: now, in the foreground
        else:
            self._meet_then_commit(error, pending, group)
        self.used = True
        self.sharded = sharded
        self.live = live if sharded else None
        watch(self, target)
        logger.debug(
            "snapshot of step %d in %.3f s (%s copied here)",
            step,
            time.perf_counter() - started,
            shown_size(self.copied),
        )

    def _agree_then_commit(self, error: BaseException | None, pending: PendingSnapshot | None) -> None:
        """FSDP2: every rank learns every rank's outcome, then commits its own part; nothing when any rank failed."""
        try:
            _agree(error)
        except BaseException:
            if pending is not None:
                pending.abort()
            raise
        if pending is not None:
            self.commits.later(pending)

    def _meet_then_commit(self, error: BaseException | None, pending: PendingSnapshot | None, group: Any) -> None:
        """The node's writer commits once the node's ranks met with no failure; every rank agrees on the outcome."""
        try:
            if group is not None and meet(error, group) and pending is not None:
                pending.abort()  # another local rank failed its share: its error is agreed on below
            elif pending is not None and error is None:
                self.commits.later(pending)
            pending = None
        except Exception as err:
            error = error or err
        finally:
            if pending is not None:
                pending.abort()
        if is_distributed():
            _agree(error)
        elif error is not None:
            raise error

    # --- the commit and the copy into the folder (.commit, .folder_copy) ---

    @property
    def newest(self) -> Snapshot | None:
        """The newest snapshot this process committed (the node's writer's; an FSDP2 rank's own)."""
        return self.commits.newest

    @newest.setter
    def newest(self, snapshot: Snapshot | None) -> None:
        self.commits.newest = snapshot

    def _join_commit(self, *, raising: bool) -> None:
        self.commits.join(raising=raising)

    def copies_step(self, step: int) -> CopyTask | None:
        """On rank 0: the copy ``save(step)`` makes of this process's snapshot of ``step`` instead of saving again
        (:meth:`FolderCopies.task`), or None. Local."""
        return self.copies.task(step)

    def copy_in_background(self, target: SaveTarget, dest: Location, copy: CopyTask) -> None:
        """Copy the snapshot of ``copy.step`` into ``dest`` in the background (:meth:`FolderCopies.start`). Collective:
        every rank passes rank 0's ``copy``."""
        self.copies.start(target, dest, copy)

    def _join_copy(self, *, raising: bool = True) -> None:
        self.copies.join(raising=raising)

    # --- the end ---

    def close(self, target: SaveTarget) -> None:
        """Collective: copy the newest snapshot into the folder (striped across rank 0's node's ranks as a save's copy,
        or rank 0 alone; FSDP2: every rank its shards), then free every node's shared memory."""
        if not self.used or self.forked:
            return
        if self.sharded:
            self._close_sharded(target)
            return
        copy = run_on_rank0(
            lambda: self.copies.newest(target, stripe=True), fallback=CheckpointWriteError, task="copy a snapshot"
        )
        if copy is not None:  # striped across rank 0's node's ranks, as a save's copy
            self.copy_in_background(target, target.file(copy.step), copy)
            run_on_rank0(self._join_copy, fallback=CheckpointWriteError, task="copy a snapshot")
        self._join_copy(raising=False)  # this rank's share: over once rank 0's copy is
        if rank_info().local_rank == 0:
            self._join_commit(raising=False)  # no record may follow the removal
            remove_snapshots(self.folder)
        else:
            release_mappings(self.folder)  # the writer's slots this rank copied its shares into
        self.newest = None
        self.used = False
        unwatch(self)

    def resumed_from(self, choice: MemoryChoice, live: LiveObjects) -> None:
        """After a resume from ``choice``: this node's copy is the newest snapshot (close() copies it into the folder if
        the folder does not hold its step; :meth:`watch` arms the same at an unplanned end). Local."""
        if choice.own is not None and (choice.sharded or rank_info().local_rank == 0):
            self.newest = choice.own
        self.sharded = choice.sharded
        self.live = live if choice.sharded else None
        if choice.sharded:
            self.exit_group = exit_group()  # collective the first time: every rank resumes from memory here
        self.used = True

    def watch(self, target: SaveTarget) -> None:
        """Copy the newest snapshot into the folder if the process ends without ``close()`` (rank 0). Local."""
        if self.used:
            watch(self, target)

    def leave(self, target: SaveTarget) -> None:
        """Local, at an error that ends a ``with`` block (perhaps on this rank alone): :meth:`at_exit`, then forget the
        snapshots without freeing them, so that ``close()`` makes no collective call for them."""
        self.at_exit(target, alone=True)
        self.newest = None
        self.used = False
        unwatch(self)

    def at_exit(self, target: SaveTarget, *, alone: bool = False) -> None:
        """Local, at an unplanned end (exception, SIGTERM, no close()): each node's local rank 0 finishes the commit
        under way, rank 0 copies its newest snapshot into the folder; the snapshots stay, for the restart that may
        follow. FSDP2: every rank its commit, then, unless this rank ends ``alone`` (an exception in a ``with``
        block), every rank together writes the newest snapshot on the exit group (:func:`~.shards.persist_newest`;
        a rank gone: nothing, within :data:`~.shards.EXIT_WAIT_S`). Nothing in a forked child."""
        if not self.used or self.forked:
            return
        if rank_info().local_rank == 0 or self.sharded:
            self._join_commit(raising=False)
        if self.sharded:
            if not alone and self.exit_group is not None:
                try:
                    persist_newest(self.folder, target, self.live, self.exit_group)
                except Exception as err:
                    logger.warning(
                        "at exit, the ranks did not write the newest snapshot into %s together (%s); it stays in "
                        "shared memory",
                        shown_path(self.folder),
                        err,
                    )
            return
        if global_rank() != 0:
            return
        try:
            self.copies.newest(target)
        except Exception as err:
            logger.warning("at exit, copying the newest snapshot into %s failed: %s", shown_path(self.folder), err)

    def copy_sharded(self, target: SaveTarget, live: LiveObjects, step: int) -> Location | None:
        """FSDP2, at ``save(step)``: when every rank's newest snapshot is of ``step``, write the sharded checkpoint folder
        from the snapshots in a background thread on every rank (:func:`~.shards.persist_own`) and return its path;
        None otherwise (the caller saves the live state). A commit that failed on some rank is every rank's error.
        Collective."""
        error: BaseException | None = None
        try:
            self._join_commit(raising=True)
        except Exception as err:
            error = err
        _agree(error)
        newest = self.newest
        if newest is None or not held_everywhere(newest, step):
            return None
        return persist_own(newest, target, live, background=True)

    def _close_sharded(self, target: SaveTarget) -> None:
        """:meth:`close` of an FSDP2 job's snapshots: the newest step every rank holds, when the folder lacks it, written
        as a sharded checkpoint folder now; then each node's memory freed. Collective."""
        self._join_commit(raising=False)  # no record may follow the removal
        wait_pending()  # a save(step) copying a snapshot in the background
        persist_newest(self.folder, target, self.live)
        if rank_info().local_rank == 0:
            remove_snapshots(self.folder)
        else:
            release_mappings(self.folder)  # this rank's own slots: their memory goes with the names
        self.newest = None
        self.used = False
        self.live = None
        unwatch(self)


def _agree(error: BaseException | None) -> None:
    """Collective: every rank raises the same error when some rank failed to take the snapshot (the lowest failing
    rank's, its class and attributes, naming every failing rank; a :class:`CheckpointWriteError` for one that is no
    dist_resume error). A peer lost: this rank's own error, else a :class:`CheckpointWriteError`."""
    mine = Outcome() if error is None else Outcome.failed(global_rank(), error)
    try:
        with collective_step("agreeing that every rank took its part of the snapshot", CheckpointWriteError):
            outcomes: list[Outcome] = all_gather_objects(mine)
    except DistResumeError:
        if error is not None:
            raise error from None
        raise
    agreed = first_failure(outcomes, CheckpointWriteError, "could not take the snapshot")
    if agreed is not None:
        raise agreed from error
