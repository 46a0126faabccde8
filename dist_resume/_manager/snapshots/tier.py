"""What one manager's process knows of its folder's snapshots, and the calls that take one, commit it in the
background, copy it into the folder and free it."""

from __future__ import annotations

import time
from typing import Any

from ..._checkpoint.objects import LiveObjects
from ..._core.errors import CheckpointWriteError, UsageError
from ..._core.location import Location
from ..._core.log import logger, shown_path, shown_size
from ..._core.rank import global_rank
from ..._dist.comm import run_on_rank0
from ..._dist.env import rank_info
from ..._save.async_save import wait_pending
from ..._save.save import prepare_payload
from ..._shm import (
    PendingSnapshot,
    Snapshot,
    make_identity,
    release_mappings,
    remove_snapshots,
    remove_stale,
)
from ..._shm.place import required_root
from ..._shm.record import checked_step
from ..._state.sharded import is_sharded
from ..folder_save import SaveTarget
from .choose import MemoryChoice
from .commit import Commits
from .evidence import Evidence
from .exit import owner, unwatch, watch
from .folder_copy import FolderCopies
from .outcome import agree, agree_then_commit
from .reuse import retire_step, still_live
from .shards import begin_own, exit_group, held_everywhere, own_object, persist_newest, persist_own
from .split import copy_share, node_group, receive, splits
from .striped_copy import CopyTask
from .writer import begin_write

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
        self.evidence: Evidence | None = None  # what the newest snapshot this process wrote holds (.evidence)
        self.identity: str | None = None  # the folder's (_shm.identity), once a snapshot or a resume learned it
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
        unless it is small (:data:`~.commit.COMMIT_INLINE_BYTES`). The previous snapshot's commit and copy are waited
        for first, and their error is this call's. Under DDP with several local ranks each copies its share of a large
        state (:mod:`.split`); every rank learns every rank's outcome before anything is committed, and any rank's
        failure is the same error on every rank, nothing committed. Its collective calls, once the first snapshot
        took the folder's lock: the check-in, every rank's RNG streams gathered, the split copy's plan sent to the
        node's ranks (a large state only), the outcome agreed on."""
        sharded = live.model is not None and is_sharded(live.model)
        if sharded and target.full_state:
            raise UsageError(
                "CheckpointManager(full_state=True).snapshot() of an FSDP2 model: its snapshots hold each rank's own "
                "shards, which reach the folder as a sharded checkpoint, not as one full file",
                hint="drop full_state=True to snapshot (the folder then gets ckpt_<step>.dcp folders), or save() alone",
            )
        required_root()  # no shared memory (not Linux): a UsageError on every rank before anything is written
        wait_pending()

        step = checked_step(step)  # nothing past int64 is ever written; every rank refuses it before a collective
        first = self.identity is None
        if first:  # rank 0 takes the folder's write lock and learns its identity: a second job on the folder stops here

            def prepare() -> str:  # the previous copy's error first, then the lock, the leftovers, the identity
                self._join_copy()
                target.prepare()
                return make_identity(self.folder)

            self.identity = run_on_rank0(prepare, task="prepare the snapshot")
            if sharded or rank_info().local_rank == 0:
                remove_stale(self.folder, self.identity)  # an earlier history's snapshots: never mixed with this one
        started = time.perf_counter()
        build, saved_epoch = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True, everywhere=True)
        group = node_group() if splits(live.model, live.optimizer) else None

        def payload() -> dict[str, Any]:  # the writer: the previous snapshot's commit error first
            self._join_commit(raising=True)
            if not first and global_rank() == 0:  # rank 0's checks, agreed on with the snapshot's outcome
                self._join_copy()  # the previous copy's error
                target.lock.acquire()  # held since the first snapshot: a check (a lease lost raises)
            return build()

        error: BaseException | None = None
        pending: PendingSnapshot | None = None
        evidence: Evidence | None = None
        self.copied = 0
        self.evidence = None
        try:
            if sharded or rank_info().local_rank == 0:  # FSDP2: every rank its own shards (.shards), no node writer
                written = (
                    begin_own(self.folder, payload, step, saved_epoch, live, self.identity)
                    if sharded
                    else begin_write(
                        self.folder, payload, step, saved_epoch, live.model, group, live=live, identity=self.identity
                    )
                )
                pending, self.copied, evidence = written
            elif group is not None:
                plan = receive(group)
                if plan is not None:
                    self.copied = copy_share(build(), plan)
        except Exception as err:
            error = err
        agree_then_commit(self.commits, error, pending)
        if sharded:
            self.exit_group = exit_group()  # collective the first time: now, in the foreground
        if pending is not None:
            self.evidence = evidence  # committed (or being committed): what it holds, for save(step)
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

    def save_from_snapshot(
        self, target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any
    ) -> Location | None:
        """The body of ``save(step)`` once snapshots were taken: when the snapshot of ``step`` (committed, or being
        committed) still holds the live state (:mod:`.reuse`), its bytes are copied into the folder in a background
        thread (rank 0, striped across its node's ranks; FSDP2: every rank its shards, when every rank's is still live)
        and the checkpoint's path is returned; otherwise None, the snapshot of ``step`` retired on every node, and the
        caller saves the live state. Collective."""
        if self.sharded:
            return self._copy_sharded(target, live, step, epoch, extra)
        build, _ = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True)

        def task() -> CopyTask | None:  # rank 0: the previous copy's error first, then the evidence
            copy = self.copies.task(step)
            return copy if copy is not None and still_live(self.evidence, step, build(), live) else None

        copy = run_on_rank0(task, task="look at the snapshots")
        if copy is None:
            self.superseded(step)
            return None
        dest = target.file(step)
        self.copy_in_background(target, dest, copy)
        return dest

    def superseded(self, step: int) -> None:
        """Before a live save of ``step``: this process's newest snapshot, when it is of ``step``, is retired (each
        node's writer; FSDP2: every rank), so that nothing later takes its bytes for ``step``'s state. Local."""
        if self.used and not self.forked and (self.sharded or rank_info().local_rank == 0):
            retire_step(self.commits, step)
            self.evidence = None

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
        self.identity = choice.identity
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
                    persist_newest(self.folder, target, self.live, self.identity, self.exit_group)
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

    def _copy_sharded(
        self, target: SaveTarget, live: LiveObjects, step: int, epoch: int | None, extra: Any
    ) -> Location | None:
        """FSDP2, at ``save(step)``: when every rank's newest snapshot is of ``step`` and still holds its live state,
        write the sharded checkpoint folder from the snapshots in a background thread on every rank
        (:func:`~.shards.persist_own`) and return its path; None otherwise (the caller saves the live state). A commit
        that failed on some rank is every rank's error. Collective."""
        error: BaseException | None = None
        try:
            self._join_commit(raising=True)
        except Exception as err:
            error = err
        agree(error)
        build, _ = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True, everywhere=True)
        newest = self.newest
        mine = newest is not None and newest.step == step and still_live(self.evidence, step, own_object(build()), live)
        if newest is None or not held_everywhere(mine):
            self.superseded(step)
            return None
        return persist_own(newest, target, live, background=True)

    def _close_sharded(self, target: SaveTarget) -> None:
        """:meth:`close` of an FSDP2 job's snapshots: the newest step every rank holds, when the folder lacks it, written
        as a sharded checkpoint folder now; then each node's memory freed. Collective."""
        self._join_commit(raising=False)  # no record may follow the removal
        wait_pending()  # a save(step) copying a snapshot in the background
        persist_newest(self.folder, target, self.live, self.identity)
        if rank_info().local_rank == 0:
            remove_snapshots(self.folder)
        else:
            release_mappings(self.folder)  # this rank's own slots: their memory goes with the names
        self.newest = None
        self.used = False
        self.live = None
        unwatch(self)
