"""What one manager's process knows of its folder's snapshots, and the calls that take one, commit it in the
background, copy it into the folder and free it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any, Final

import torch.distributed as dist

from ..._checkpoint.objects import LiveObjects
from ..._core.errors import CheckpointWriteError, DistResumeError
from ..._core.location import Location
from ..._core.log import log_rank0, logger, shown_path, shown_size
from ..._core.rank import global_rank
from ..._dist.agree import first_failure
from ..._dist.comm import Outcome, all_gather_objects, collective_step, run_on_rank0
from ..._dist.env import is_distributed, rank_info
from ..._memory import (
    PendingSnapshot,
    Snapshot,
    mark_persisted,
    persist_snapshot,
    release_mappings,
    remove_snapshots,
)
from ..._memory.place import required_root
from ..._save.async_save import wait_pending
from ..._save.save import prepare_payload
from ..._source.listing import numbered_checkpoints
from ..._state.sharded import is_sharded
from ..folder_save import SaveTarget
from .choose import MemoryChoice
from .exit import unwatch, watch
from .shards import begin_own, held_everywhere, newer_than_folder, persist_own
from .split import copy_share, meet, node_group, receive, splits
from .striped_copy import CopyTask, call_off, copy_group, copy_striped, copy_striped_share, copying_ranks
from .write import begin_write

__all__ = ["MemoryTier", "COMMIT_INLINE_BYTES"]

COMMIT_INLINE_BYTES: Final = 32 << 20
"""A snapshot up to this size is committed before ``snapshot()`` returns (its CRC-32s take a few milliseconds); a
larger one in a background thread."""


class MemoryTier:
    """What one manager's process knows of its folder's snapshots: the newest this process wrote (each node's local
    rank 0 writes), whether the folder holds it, and the copy into the folder running in the background (rank 0)."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self.newest: Snapshot | None = None
        self.used = False  # this process snapshotted or resumed from memory: close() copies and frees
        self._copy: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._commit: threading.Thread | None = None  # the newest snapshot's commit, in the background
        self._committing: int | None = None  # its step
        self._commit_error: BaseException | None = None
        self._lock = threading.Lock()
        self.copied = 0  # the tensor bytes this process copied into the last snapshot
        self.sharded = False  # FSDP2: every rank writes its own shards (.shards), no node writer
        self.live: LiveObjects | None = None  # FSDP2: the objects of the last snapshot, whose specs close() writes

    # --- snapshot ---

    def take(self, target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any) -> None:
        """The body of :meth:`CheckpointManager.snapshot`. Collective under torch.distributed. Returns once the
        snapshot's data is in shared memory; its commit (the CRC-32s, then the record) follows in a background thread
        unless it is small (:data:`COMMIT_INLINE_BYTES`). The previous snapshot's commit is waited for first, and its
        error is this call's. Under DDP with several local ranks each copies its share (:mod:`.split`) and the node's
        ranks meet before the commit; any rank's failure is the same error on every rank, nothing committed."""
        sharded = live.model is not None and is_sharded(live.model)
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
            self._commit_later(pending)

    def _meet_then_commit(self, error: BaseException | None, pending: PendingSnapshot | None, group: Any) -> None:
        """The node's writer commits once the node's ranks met with no failure; every rank agrees on the outcome."""
        try:
            if group is not None and meet(error, group) and pending is not None:
                pending.abort()  # another local rank failed its share: its error is agreed on below
            elif pending is not None and error is None:
                self._commit_later(pending)
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

    # --- the commit ---

    def _commit_later(self, pending: PendingSnapshot) -> None:
        """Commit ``pending`` now when it is small, else in a background thread (its error at the next call)."""
        if pending.size <= COMMIT_INLINE_BYTES:
            self.newest = pending.commit()
            return

        def run() -> None:
            try:
                snapshot = pending.commit()
            except BaseException as err:
                self._commit_error = err
                return
            with self._lock:
                self.newest = snapshot

        self._committing = pending.step
        self._commit = threading.Thread(target=run, name=f"dist_resume-commit-{pending.step}", daemon=False)
        self._commit.start()

    def _join_commit(self, *, raising: bool) -> None:
        """Wait for the snapshot being committed; its error is raised (``raising``) or logged once."""
        thread = self._commit
        if thread is not None:
            thread.join()
            self._commit = self._committing = None
        error, self._commit_error = self._commit_error, None
        if error is None:
            return
        if raising:
            raise CheckpointWriteError(f"committing a snapshot of {str(self.folder)!r} failed: {error}") from error
        logger.warning("committing a snapshot of %s failed: %s", shown_path(self.folder), error)

    # --- the copy into the folder ---

    def copies_step(self, step: int) -> CopyTask | None:
        """On rank 0: whether ``save(step)`` can copy this process's snapshot of ``step`` (committed, or being
        committed) instead of saving again, once the previous copy is done (its error raised here): the copy, with
        how many ranks make it (:func:`~.striped_copy.copying_ranks`), or None. Local."""
        self._join_copy()
        if self._committing is not None:
            held = self._committing == step
        else:
            newest = self.newest
            held = newest is not None and newest.step == step
        return CopyTask(step, copying_ranks(self.folder)) if held else None

    def copy_in_background(self, target: SaveTarget, dest: Location, copy: CopyTask) -> None:
        """Copy the snapshot of ``copy.step`` into ``dest`` once it is committed, then rotate, in a thread; its error is
        raised at the next ``snapshot``, ``save`` or ``close``, on every rank. Collective: every rank passes rank 0's
        ``copy``. With ``copy.ranks`` > 1 (a local folder) the copy is striped (:mod:`.striped_copy`): ranks
        ``1 .. copy.ranks - 1``, rank 0's node, each copy their range of the file in a thread of their own, on a group
        made the first time by every rank; the other ranks return at once."""
        self._join_copy(raising=False)  # this rank's previous share: two copies never share the group
        path = dest if isinstance(dest, Path) else None
        group = copy_group(copy.ranks) if copy.ranks > 1 and path is not None else None
        rank, commit, step = global_rank(), self._commit, copy.step

        def share(path: Path) -> None:
            try:
                copy_striped_share(path, group)
            except BaseException as err:  # rank 0's copy fails too: its error is every rank's at the next call
                logger.debug("rank %d's share of the snapshot copy into %s failed: %s", rank, path, err)

        def run() -> None:
            try:
                if commit is not None:
                    commit.join()
                snapshot = self.newest
                if snapshot is None or snapshot.step != step:  # its commit failed: that error comes at the next call
                    if group is not None:
                        call_off(group)
                    raise CheckpointWriteError(f"the snapshot of step {step} was not committed; nothing was copied")
                self._copy_now(target, snapshot, dest, group)
            except BaseException as err:
                self._copy_error = err

        if rank == 0:
            self._copy = threading.Thread(target=run, name=f"dist_resume-copy-{step}", daemon=False)
        elif group is not None and path is not None and rank < copy.ranks:
            self._copy = threading.Thread(target=share, args=(path,), name=f"dist_resume-copy-{step}", daemon=False)
        else:
            return
        self._copy.start()

    def _copy_now(self, target: SaveTarget, snapshot: Snapshot, dest: Location, group: Any = None) -> None:
        """On rank 0: copy ``snapshot`` into ``dest`` (striped over ``group``, collective on it; or alone), mark it
        copied, say so, rotate."""
        started = time.perf_counter()
        striped = group is not None and isinstance(dest, Path) and copy_striped(snapshot, dest, group)
        if not striped:
            persist_snapshot(snapshot, dest)
        marked = mark_persisted(snapshot)
        with self._lock:
            if marked is not None and self.newest is not None and self.newest.seq == snapshot.seq:
                self.newest = marked
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

    def _join_copy(self, *, raising: bool = True) -> None:
        """Wait for this process's copy into the folder (rank 0's, or this rank's share of a striped one); rank 0's
        error is raised (``raising``; else it waits for the next call). Local."""
        thread, self._copy = self._copy, None
        if thread is not None:
            thread.join()
        if not raising:
            return
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise CheckpointWriteError(f"copying a snapshot into {str(self.folder)!r} failed: {error}") from error

    def copy_newest(self, target: SaveTarget, *, stripe: bool = False) -> CopyTask | None:
        """On rank 0: copy this process's newest snapshot (its commit waited for) into the folder unless it holds that
        step already. Local. ``stripe`` (for ``close()``, collective): the previous copy's error is raised here, and a
        copy that stripes (:func:`~.striped_copy.copying_ranks`) is returned, for every rank to make. Without (at an
        unplanned end, rank 0 alone) that error is logged and rank 0 copies the newest snapshot itself."""
        self._join_commit(raising=False)
        if stripe:
            self._join_copy()
        else:
            try:
                self._join_copy()
            except CheckpointWriteError as err:  # a striped copy whose peers are gone (a SIGTERM): rank 0 alone now
                logger.warning("%s; copying the newest snapshot again, from rank 0 alone", err)
        snapshot = self.newest
        if snapshot is None or snapshot.persisted:
            return None
        newest_saved = max((s for s, _ in numbered_checkpoints(target.folder)), default=None)
        if newest_saved is not None and newest_saved >= snapshot.step:
            return None
        ranks = copying_ranks(self.folder) if stripe else 1
        if ranks > 1:
            return CopyTask(snapshot.step, ranks)
        self._copy_now(target, snapshot, target.file(snapshot.step))
        return None

    # --- the end ---

    def close(self, target: SaveTarget) -> None:
        """Collective: copy the newest snapshot into the folder (striped across rank 0's node's ranks as a save's copy,
        or rank 0 alone; FSDP2: every rank its shards), then free every node's shared memory."""
        if not self.used:
            return
        if self.sharded:
            self._close_sharded(target)
            return
        copy = run_on_rank0(
            lambda: self.copy_newest(target, stripe=True), fallback=CheckpointWriteError, task="copy a snapshot"
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
        self.used = True

    def watch(self, target: SaveTarget) -> None:
        """Copy the newest snapshot into the folder if the process ends without ``close()`` (rank 0). Local."""
        if self.used:
            watch(self, target)

    def leave(self, target: SaveTarget) -> None:
        """Local, at an error that ends a ``with`` block (perhaps on this rank alone): :meth:`at_exit`, then forget the
        snapshots without freeing them, so that ``close()`` makes no collective call for them."""
        self.at_exit(target)
        self.newest = None
        self.used = False
        unwatch(self)

    def at_exit(self, target: SaveTarget) -> None:
        """Local, at an unplanned end (exception, SIGTERM, no close()): each node's local rank 0 finishes the commit
        under way, rank 0 copies its newest snapshot into the folder; the snapshots stay, for the restart that may
        follow."""
        if not self.used:
            return
        if rank_info().local_rank == 0 or self.sharded:
            self._join_commit(raising=False)
        if global_rank() != 0 or self.sharded:  # a sharded folder is every rank's collective write: memory keeps it
            return
        try:
            self.copy_newest(target)
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
        newest = self.newest
        unsaved = None if newest is None or newest.persisted else newest.step
        with collective_step("asking every rank for its newest snapshot", CheckpointWriteError):
            steps: list[int | None] = all_gather_objects(unsaved)
        step = steps[0]
        live = self.live
        if newest is not None and step is not None and all(s == step for s in steps) and live is not None:
            if run_on_rank0(lambda: newer_than_folder(target, step), task="look at the checkpoint folder"):
                persist_own(newest, target, live, background=False)
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
