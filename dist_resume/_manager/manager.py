"""Checkpoint folders: the manager that saves numbered checkpoints into one, rotates and resumes.

What a folder holds and which checkpoint counts is :mod:`~dist_resume._source.listing`'s; how a run starts is
:mod:`~dist_resume._manager.start`'s; the steps of one save are :mod:`~dist_resume._manager.folder_save`'s, and
cleaning up and rotating after a save :mod:`~dist_resume._manager.rotation`'s.
"""

from __future__ import annotations

import functools
import os
import sys
import weakref
from collections.abc import Mapping
from datetime import timedelta
from types import TracebackType
from typing import Any

from .._checkpoint.objects import LiveObjects, TrainingObjects, data_position
from .._checkpoint.options import ResumeOptions
from .._checkpoint.restore import ResumeResult, checked_options
from .._core.location import Location
from .._core.log import logger
from .._core.types import PathLike
from .._dist.checkin import check_in, timeout_seconds
from .._save.async_save import AsyncSave
from .._save.saveable import check_saveable
from .._source.listing import latest_checkpoint, numbered_checkpoints
from .._store.url import location
from .epoch_end import EpochEnd, Held
from .folder_save import SaveTarget, save_into, save_into_async
from .lease import PrefixLease, lock_for_resume, writer_lock
from .lock import FolderLock
from .snapshots import MemoryTier
from .start import start_run

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # typing_extensions comes with torch
    from typing_extensions import Unpack

__all__ = ["CheckpointManager"]


def _release(lock: FolderLock | PrefixLease) -> None:
    lock.release()


class CheckpointManager:
    """A folder of numbered checkpoints for one run: its objects registered once, crash-safe saves, rotation,
    the latest valid checkpoint, and a resume that picks it.

    ``CheckpointManager(folder, model=..., optimizer=..., scheduler=..., scaler=..., dataloader=..., ema=...)``
    registers the run's objects (:class:`TrainingObjects`; ``sampler=`` for a loop that iterates a
    :class:`ResumableDistributedSampler` itself); ``save(step)``, ``save_async(step)`` and ``resume()`` then take
    only what changes per call. A keyword given to one call replaces the registered object for that call
    (``mgr.save(step, model=other)``; ``optimizer=None``: not this time); an unknown keyword is a
    :class:`~dist_resume.errors.UsageError` at once. ``options`` (a :class:`ResumeOptions`) is what
    :meth:`resume` uses unless it is given its own.

    ``save`` writes ``ckpt_<step>.pt`` atomically (an FSDP2 model: the sharded folder ``ckpt_<step>.dcp/``, every rank
    its own shards; ``full_state=True``: one file gathered on rank 0), removes temporary files of interrupted saves,
    and only then deletes all but the newest ``keep_last`` checkpoints (counting the one just written: 1 is
    crash-safe, the default 2 keeps a fallback for one damaged later). ``latest()`` returns the newest checkpoint that
    passes the integrity check. ``folder`` may be a URL (``s3://bucket/run``, ``gs://``, any fsspec protocol, with
    ``storage_options`` and a local ``cache_dir``): each checkpoint is then one object, visible only once complete,
    resumed by ranged reads straight into the tensors (docs/checkpoint-folders.md#remote-folders-object-stores).

    One writer per folder: :meth:`resume` and the first ``save``/``save_async`` take an exclusive lock on the folder
    (``flock`` on ``<folder>/.dist_resume.lock`` on global rank 0; on an object store a lease object,
    ``<folder>/.dist_resume.lease``) and hold it until :meth:`close` (or the end of a ``with`` block, or the manager
    being garbage-collected): another manager that resumes or saves into the folder meanwhile gets a
    :class:`~dist_resume.errors.CheckpointWriteError` naming the holder before it reads or writes anything. A lock
    never outlives its holder, a relaunch takes a dead holder's lease over, and reading never takes it
    (docs/checkpoint-folders.md#what-a-folder-guarantees).

    ``save``, ``snapshot``, ``save_async``, ``resume`` and a ``close`` that waits are collective: every rank calls
    them. A call made on some ranks only (a save inside ``if rank == 0:``) is named at WARNING after
    ``$DIST_RESUME_COLLECTIVE_WARN`` seconds (15) and raises :class:`~dist_resume.errors.UsageError` with the fix at
    ``collective_timeout`` (seconds or a timedelta; default ``$DIST_RESUME_COLLECTIVE_TIMEOUT``, else the group's).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mgr = dist_resume.CheckpointManager("ckpts", model=model, optimizer=opt, keep_last=2)
        >>> print(mgr.resume())  # a first run: nothing to resume
        None
        >>> for step in (100, 200, 300):
        ...     path = mgr.save(step)
        >>> [p.name for p in mgr.checkpoints()]
        ['ckpt_00000200.pt', 'ckpt_00000300.pt']
        >>> dist_resume.resume("ckpts", model=model, optimizer=opt).step
        300
        >>> mgr.close()  # or: with dist_resume.CheckpointManager("ckpts", ...) as mgr: ...
    """

    def __init__(
        self,
        folder: PathLike,
        *,
        keep_last: int = 2,
        options: ResumeOptions | None = None,
        full_state: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        collective_timeout: float | timedelta | None = None,
        **objects: Unpack[TrainingObjects],
    ) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an int >= 1, got {keep_last!r}: it counts the checkpoint just saved, "
                "which is always kept (older ones are deleted only once it is durable, so 1 is crash-safe); "
                "use 2 or more to keep a fallback in case the newest file is damaged later"
            )
        data_position(objects, saving=False, where="CheckpointManager()")  # unknown names fail here, not at a save
        self.folder = location(folder, storage_options=storage_options, cache_dir=cache_dir)
        self.keep_last = keep_last
        self.full_state = bool(full_state)
        self.options = checked_options(options)
        self.collective_timeout = timeout_seconds(collective_timeout, what="collective_timeout")
        self._objects: dict[str, Any] = dict(objects)
        self._lock = writer_lock(self.folder)
        self._pending: AsyncSave | None = None
        self._memory = MemoryTier(self.folder)
        self._epoch_end = EpochEnd()  # a save or snapshot right after an epoch's last batch waits for its end
        # the lock is released when the manager is garbage-collected, as on close()
        self._finalizer = weakref.finalize(self, _release, self._lock)

    def __repr__(self) -> str:
        full = ", full_state=True" if self.full_state else ""
        return f"CheckpointManager({str(self.folder)!r}, keep_last={self.keep_last}{full})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:  # do not hide the error that ends the block behind a background save's error
            try:
                # the error may be this rank's alone: no collective for the snapshots (rank 0 copies the newest into
                # the folder, the snapshots stay for a restart), then close() as ever
                self._memory.leave(self._target())
                self.close()
            except Exception as close_err:
                logger.warning("closing %r after an error: %s", self, close_err)

    def close(self) -> None:
        """Wait for this manager's pending asynchronous save, then release the folder's write lock.

        Collective under torch.distributed when an asynchronous save is pending that nobody waited
        for (it waits like :meth:`AsyncSave.wait`, and raises its error); otherwise local.
        Idempotent. A later ``save`` or ``resume`` takes the lock again.
        """
        self._epoch_end.write_held(None, self._write_held)  # a save held at an epoch's end: the run ends here
        pending, self._pending = self._pending, None
        try:
            if (pending is not None and not pending.waited) or self._memory.used:
                self._check_in("close()")
            if pending is not None and not pending.waited:
                pending.wait()
            self._memory.close(self._target())
        finally:
            self._lock.release()

    @property
    def lock_path(self) -> Location:
        """The lock file, ``<folder>/.dist_resume.lock`` (present once a manager has resumed or saved here), or on
        an object store the lease, ``<folder>/.dist_resume.lease`` (present while a manager holds it)."""
        return self._lock.path

    def checkpoints(self) -> list[Location]:
        """Every file in the folder named like a checkpoint (``ckpt_<step>.pt``), oldest step first; ``[]`` before the
        folder exists. Local; names only (:meth:`latest` checks contents; ``dist-resume list DIR`` shows both), never
        temporary files of interrupted saves, the lock or anything else (docs/checkpoint-folders.md).

        Example::

            >>> mgr = dist_resume.CheckpointManager("ckpts", model=torch.nn.Linear(2, 2), keep_last=3)
            >>> _ = mgr.save(10)
            >>> [p.name for p in mgr.checkpoints()]
            ['ckpt_00000010.pt']
        """
        return [path for _, path in numbered_checkpoints(self.folder)]

    def resume(
        self,
        *,
        init_from: PathLike | None = None,
        options: ResumeOptions | None = None,
        **objects: Unpack[TrainingObjects],
    ) -> ResumeResult | None:
        """Continue this folder's run, start from another run's checkpoint, or start fresh (None).

        Collective under torch.distributed: call it on every rank. Global rank 0 looks at the folder and takes its
        write lock (creating the folder on a first run; a folder another live job holds raises
        :class:`~dist_resume.errors.CheckpointWriteError` naming the holder, before anything is read), and every rank
        takes the branch it decides (docs/checkpoint-folders.md says each whole):

        - the folder holds checkpoints: its newest complete one (or a newer snapshot in shared memory) is restored into
          the registered objects, rank 0 choosing and every rank confirming; ``result.step`` is where the loop
          continues. All of them damaged raises :class:`~dist_resume.errors.CheckpointCorruptError`, a rank that sees
          other files :class:`~dist_resume.errors.CheckpointConsensusError` (every rank): never a silent fresh start;
        - none, and ``init_from`` is given (a checkpoint file or folder of another run, any world size or layout
          :func:`resume` reads): a new run starting from its **model** (and the optimizer's per-parameter state and
          the EMA when it holds them); the optimizer's hyperparameters, the scheduler, scaler, data position and RNG
          streams stay this run's. The result has ``step=0`` and ``epoch=0``, the other run's step in
          ``metadata["step"]``; a missing ``init_from`` raises :class:`~dist_resume.errors.CheckpointNotFoundError`;
        - none and no ``init_from``: None ("no checkpoint in X: starting fresh" at INFO on rank 0).

        A folder whose parent does not exist either is taken for a mistyped path
        (:class:`~dist_resume.errors.CheckpointNotFoundError`). ``options`` (default: the manager's) applies to both
        restoring branches. A resume that raises releases the write lock it took (one held before stays).

        Example::

            >>> model = torch.nn.Linear(2, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            >>> mgr = dist_resume.CheckpointManager("run", model=model, optimizer=opt, keep_last=2)
            >>> print(mgr.resume())  # first run: nothing to resume
            None
            >>> _ = mgr.save(5)
            >>> mgr.resume().step
            5
        """
        live = self._live(objects, saving=False, where="resume")
        self._check_in("resume()")
        opts = self.options if options is None else checked_options(options)
        held = self._lock.held
        try:
            take_lock = functools.partial(lock_for_resume, self._lock)
            result = start_run(self.folder, live, opts, init_from=init_from, take_lock=take_lock, memory=self._memory)
            self._memory.watch(self._target())
            return result
        except BaseException:
            if not held:  # a resume that raises leaves nothing held: the relaunch after the fix takes the folder
                self._lock.release()
            raise

    def latest(self, *, verify: bool = True) -> Location | None:
        """The newest complete checkpoint, or None. Local; see :func:`dist_resume.tools.latest_checkpoint`."""
        return latest_checkpoint(self.folder, verify=verify)

    def save(
        self, step: int, *, epoch: int | None = None, extra: Any = None, **objects: Unpack[TrainingObjects]
    ) -> Location:
        """Save the checkpoint of ``step`` (see :func:`save_checkpoint`), then rotate; return its path.

        Collective under torch.distributed: call it on every rank; rank 0 takes the folder's write lock (unless
        :meth:`resume` did), writes and rotates, and every rank returns once the file is durable (or raises rank 0's
        :class:`~dist_resume.errors.CheckpointWriteError`). The registered objects are saved (a keyword replaces one
        for this call), every rank's RNG streams too; rotation problems are logged, never raised. Right after the
        registered loader's last batch of an epoch the save is held and written when the loop moves on (before the
        loader's next iterator, at the next call of ``step``, or at :meth:`close`), so that it holds the epoch's end
        (a per-epoch scheduler step, an evaluation); the path returned is the one it gets
        (docs/exact-resume.md#a-save-at-an-epochs-last-batch).
        """
        live = self._live(objects, saving=True, where="save")
        self._check_in(f"save(step={step!r})")
        held = Held("save", step, epoch, extra, objects)
        refuse = lambda: check_saveable(live, step=step, epoch=epoch, extra=extra, where="CheckpointManager.save()")  # noqa: E731
        if self._epoch_end.hold(held, live.data, self._write_held, check=refuse):  # refused now, not when written
            return self._target().file(step)  # written when the loop starts the next epoch (epoch_end.py)
        target = self._target()
        if self._memory.used:  # the snapshot of step, when it still holds the live state: copied in the background
            copied = self._memory.save_from_snapshot(target, live, step, epoch=epoch, extra=extra)
            if copied is not None:
                return copied
        return save_into(target, live, step, epoch=epoch, extra=extra)

    def snapshot(
        self, step: int, *, epoch: int | None = None, extra: Any = None, **objects: Unpack[TrainingObjects]
    ) -> None:
        """Keep the state of ``step`` in this node's shared memory (``/dev/shm``); a restart resumes from it.

        Collective under torch.distributed, like :meth:`save`: call it on every rank. It returns once the state is
        in host shared memory, as the standard torch file ``save`` writes, in one of two slots (the newest complete
        snapshot is never the one being written; a process killed halfway leaves the previous one; under DDP the
        node's ranks each copy their share; an FSDP2 model's ranks each keep their own shards). Nothing reaches the
        folder: ``save(step)`` of the same step copies the snapshot there in the background when nothing it holds
        changed since (else the live state is saved), ``close()`` copies the newest one the folder lacks and frees
        the memory, and a process that ends otherwise (an exception, SIGTERM) copies it too but keeps the snapshots
        for the restart. :meth:`resume` resumes from memory when a snapshot newer than the folder's newest checkpoint
        can restore every rank (``ResumeResult.source == "memory"``). Right after an epoch's last batch it is held
        as :meth:`save` is. Linux only (elsewhere :class:`~dist_resume.errors.UsageError`); too little shared memory
        is a :class:`~dist_resume.errors.CheckpointWriteError` before the previous snapshot is touched;
        ``$DIST_RESUME_SHM_DIR`` puts the snapshots elsewhere. See docs/checkpoint-folders.md#snapshots-in-host-memory.
        """
        live = self._live(objects, saving=True, where="snapshot")
        check_saveable(live, step=step, epoch=epoch, extra=extra, where="CheckpointManager.snapshot()")
        self._check_in(f"snapshot(step={step!r})")
        if self._epoch_end.hold(Held("snapshot", step, epoch, extra, objects), live.data, self._write_held):
            return
        self._memory.take(self._target(), live, step, epoch=epoch, extra=extra)

    def save_async(
        self, step: int, *, epoch: int | None = None, extra: Any = None, **objects: Unpack[TrainingObjects]
    ) -> AsyncSave:
        """Like :meth:`save`, but return once the state is snapshotted (see :func:`save_checkpoint_async`).

        Collective under torch.distributed. The write stays atomic, and rotation runs in the
        background thread only after the new checkpoint is durable.
        """
        live = self._live(objects, saving=True, where="save_async")
        self._check_in(f"save_async(step={step!r})")
        self._epoch_end.drop_older(step)
        self._epoch_end.write_held(step, self._write_held)
        self._memory.superseded(step)  # a snapshot of step no longer stands for it
        self._pending = save_into_async(self._target(), live, step, epoch=epoch, extra=extra)
        return self._pending

    def _write_held(self, held: Held) -> None:
        call = self.save if held.kind == "save" else self.snapshot
        call(held.step, epoch=held.epoch, extra=held.extra, **held.objects)  # type: ignore[arg-type]

    def _check_in(self, call: str) -> None:
        check_in(f"CheckpointManager.{call}", timeout=self.collective_timeout)

    def _target(self) -> SaveTarget:
        return SaveTarget(self.folder, self._lock, self.keep_last, self.full_state)

    def _live(self, objects: Mapping[str, Any], *, saving: bool, where: str) -> LiveObjects:
        where = f"CheckpointManager.{where}()"
        return LiveObjects.named(objects, saving=saving, where=where, registered=self._objects)
