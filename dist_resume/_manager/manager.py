"""Checkpoint folders: the manager that saves numbered checkpoints into one, rotates and resumes.

What a folder holds and which checkpoint counts is :mod:`~dist_resume._source.listing`'s;
cleaning up and rotating after a save is :mod:`~dist_resume._manager.rotation`'s.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .._checkpoint.async_save import AsyncSave, save_checkpoint_async, wait_pending
from .._checkpoint.restore import ResumeResult
from .._checkpoint.save import save_checkpoint
from .._core.errors import CheckpointWriteError
from .._core.log import logger
from .._core.types import PathLike
from .._dist.comm import run_on_rank0
from .._source.listing import checkpoint_name, latest_checkpoint, numbered_checkpoints
from .lock import FolderLock
from .rotation import remove_leftovers, rotate_out
from .start import start_run

__all__ = ["CheckpointManager"]


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int (it names the file), got {step!r}")
    return step


class CheckpointManager:
    """A folder of numbered checkpoints: crash-safe saves, rotation, the latest valid one.

    ``save`` writes ``ckpt_<step>.pt`` atomically and only then deletes all but the newest
    ``keep_last`` checkpoints (never the one just written), so a crash at any moment leaves the
    previous checkpoint in place. It also removes temporary files left by interrupted saves of
    this folder's checkpoints (``.ckpt_<step>.pt.<16 hex>.tmp``, nothing else). ``latest()``
    returns the newest checkpoint that passes the integrity check.

    ``keep_last`` counts the checkpoint just written: 1 is crash-safe, because the old file is
    deleted only after the new one is durable; the default 2 also keeps a fallback for a
    checkpoint damaged later (disk, copy).

    One writer per folder: the first ``save``/``save_async`` takes an exclusive lock on the
    folder (``fcntl.flock`` on ``<folder>/.dist_resume.lock``, on global rank 0, the rank that
    writes) and holds it until :meth:`close` (or the end of a ``with`` block, or the manager being
    garbage-collected). Another manager, in another job or in this process, that tries to save
    into the folder meanwhile gets a :class:`CheckpointWriteError` naming the folder and the
    holder (host, pid) before anything is written. The kernel drops the lock when its holder
    dies, even by SIGKILL, so there is never a stale lock. A manager that only reads
    (``latest()``, ``checkpoints()``, :func:`resume` from the folder) never takes it. Caveats: on
    NFS ``flock`` may be local to one client (``local_lock`` mounts, old clients), so two hosts
    could both hold it; and a process forked while the lock is held (e.g. a DataLoader worker of
    rank 0 started with ``fork``) keeps it held until it exits too.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> mgr = dist_resume.CheckpointManager("ckpts", keep_last=2)
        >>> for step in (100, 200, 300):
        ...     path = mgr.save(step, model=model, optimizer=opt)
        >>> [p.name for p in mgr.checkpoints()]
        ['ckpt_00000200.pt', 'ckpt_00000300.pt']
        >>> dist_resume.resume("ckpts", model=model, optimizer=opt).step
        300
        >>> mgr.close()  # or: with dist_resume.CheckpointManager("ckpts") as mgr: ...
    """

    def __init__(self, folder: PathLike, keep_last: int = 2) -> None:
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(
                f"keep_last must be an int >= 1, got {keep_last!r}: it counts the checkpoint just saved, "
                "which is always kept (older ones are deleted only once it is durable, so 1 is crash-safe); "
                "use 2 or more to keep a fallback in case the newest file is damaged later"
            )
        self.folder = Path(folder)
        self.keep_last = keep_last
        self._lock = FolderLock(self.folder)
        self._pending: AsyncSave | None = None
        # the lock is released when the manager is garbage-collected, as on close()
        self._finalizer = weakref.finalize(self, FolderLock.release, self._lock)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.folder)!r}, keep_last={self.keep_last})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:  # do not hide the error that ends the block behind a background save's error
            try:
                self.close()
            except Exception as close_err:
                logger.warning("closing %r after an error: %s", self, close_err)

    def close(self) -> None:
        """Wait for this manager's pending asynchronous save, then release the folder's write lock.

        Collective under torch.distributed when an asynchronous save is pending that nobody waited
        for (it waits like :meth:`AsyncSave.wait`, and raises its error); otherwise local.
        Idempotent. A later ``save`` takes the lock again.
        """
        pending, self._pending = self._pending, None
        try:
            if pending is not None and not pending.waited:
                pending.wait()
        finally:
            self._lock.release()

    @property
    def lock_path(self) -> Path:
        """The lock file, ``<folder>/.dist_resume.lock`` (present once a manager has saved here)."""
        return self._lock.path

    def checkpoints(self) -> list[Path]:
        """Every file in the folder named like a checkpoint (``ckpt_<step>.pt``), oldest step first.

        Local; looks at names only, so a listed file may still be damaged: :meth:`latest` (or
        :func:`inspect_checkpoint` on each path) checks the contents. Never lists temporary files of
        interrupted saves (``.ckpt_<step>.pt.<16 hex>.tmp``), the lock file, or anything else in the
        folder. ``[]`` when the folder does not exist yet. ``dist-resume list DIR`` shows the same
        files with their step, size, age and whether each is valid.

        Example::

            >>> mgr = dist_resume.CheckpointManager("ckpts", keep_last=3)
            >>> for step in (10, 20):
            ...     _ = mgr.save(step, model=torch.nn.Linear(2, 2))
            >>> [p.name for p in mgr.checkpoints()]
            ['ckpt_00000010.pt', 'ckpt_00000020.pt']
        """
        return [path for _, path in numbered_checkpoints(self.folder)]

    def resume(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        sampler: Any = None,
        rng: bool = False,
        init_from: PathLike | None = None,
        **resume_kwargs: Any,
    ) -> ResumeResult | None:
        """Continue this folder's run, start from another run's checkpoint, or start fresh (None).

        Collective under torch.distributed: call it on every rank. Global rank 0 looks at the folder
        and every rank takes the branch it decides:

        - The folder holds files named ``ckpt_<step>.pt``: ``resume(self.folder, ...)`` restores the
          newest complete one (rank 0 chooses, every rank confirms it sees the same file, see
          :func:`resume`); the result's ``step`` is where the loop continues. A folder whose
          checkpoints are all damaged raises :class:`CheckpointCorruptError`, a rank that sees other
          files :class:`CheckpointConsensusError` (on every rank): never a silent fresh start.
        - It holds none (no such file, or no folder yet under an existing parent: the first
          :meth:`save` creates it) and ``init_from`` is given: ``init_from`` (a checkpoint file or
          folder, saved at any world size, in any layout :func:`resume` reads) restores the
          **model**, and the **optimizer**'s per-parameter state (momentum, Adam moments and step
          counts) when one is passed. This is a new run: the optimizer keeps its own group
          hyperparameters (``lr``, ``betas``, ``weight_decay``, ``initial_lr``, ...), and
          ``scheduler``, ``scaler``, ``sampler`` and ``rng`` are left as they are. The result
          describes ``init_from`` (``path``, ``metadata``, ``restored``) with ``step=0`` and
          ``epoch=0``; the other run's step is in ``metadata["step"]`` for dist_resume files.
          A missing ``init_from`` raises :class:`CheckpointNotFoundError`.
        - It holds none and no ``init_from``: returns None (logged at INFO on rank 0,
          "no checkpoint in X: starting fresh").

        A folder whose parent does not exist either is taken for a mistyped path and raises
        :class:`CheckpointNotFoundError`. ``resume_kwargs`` (``strict``, ``map_location``,
        ``mmap``, ``weights_only``, ``verify``, ``broadcast_from_rank0``, ...) go to
        :func:`resume` in both restoring branches.

        Example::

            >>> model = torch.nn.Linear(2, 2)
            >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            >>> mgr = dist_resume.CheckpointManager("run", keep_last=2)
            >>> print(mgr.resume(model=model, optimizer=opt))  # first run: nothing to resume
            None
            >>> _ = mgr.save(5, model=model, optimizer=opt)
            >>> mgr.resume(model=model, optimizer=opt).step
            5
        """
        options = dict(resume_kwargs, scheduler=scheduler, scaler=scaler, sampler=sampler, rng=rng)
        return start_run(self.folder, model=model, optimizer=optimizer, init_from=init_from, options=options)

    def latest(self, verify: bool = True) -> Path | None:
        """The newest complete checkpoint, or None. Local; see :func:`latest_checkpoint`."""
        return latest_checkpoint(self.folder, verify)

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        epoch: int | None = None,
        extra: Any = None,
        sampler: Any = None,
        rng: bool = True,
        ema: nn.Module | None = None,
    ) -> Path:
        """Save the checkpoint of ``step`` (see :func:`save_checkpoint`), then rotate; return its path.

        Collective under torch.distributed: call it on every rank; global rank 0 creates the folder,
        takes the folder's write lock (first save only), removes stale temporary files, writes and rotates, and every rank returns once the file is
        durable (or raises rank 0's :class:`CheckpointWriteError`). Local in a single process.
        Rotation problems are logged, never raised: the new checkpoint is already safe.
        """
        path = self.folder / checkpoint_name(_check_step(step))
        wait_pending()
        run_on_rank0(self._prepare)
        save_checkpoint(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            step=step,
            epoch=epoch,
            extra=extra,
            sampler=sampler,
            rng=rng,
            ema=ema,
        )
        run_on_rank0(lambda: self._rotate(path, step))
        return path

    def save_async(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
        scaler: Any = None,
        epoch: int | None = None,
        extra: Any = None,
        sampler: Any = None,
        rng: bool = True,
        ema: nn.Module | None = None,
    ) -> AsyncSave:
        """Like :meth:`save`, but return once the state is snapshotted (see :func:`save_checkpoint_async`).

        Collective under torch.distributed. The write stays atomic, and rotation runs in the
        background thread only after the new checkpoint is durable.
        """
        path = self.folder / checkpoint_name(_check_step(step))
        wait_pending()  # the previous save's temporary file must not be mistaken for a stale one
        run_on_rank0(self._prepare)
        self._pending = save_checkpoint_async(
            path,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            step=step,
            epoch=epoch,
            extra=extra,
            sampler=sampler,
            rng=rng,
            ema=ema,
            after_write=lambda written: self._rotate(written, step),
        )
        return self._pending

    def _prepare(self) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            names = os.listdir(self.folder)
        except OSError as err:
            raise CheckpointWriteError(
                f"cannot create or list the checkpoint folder {str(self.folder)!r}: "
                f"{err.strerror or err}; check the path and its permissions"
            ) from err
        self._lock.acquire()  # before anything is written or removed
        remove_leftovers(self.folder, names)

    def _rotate(self, new: Path, step: int) -> None:
        rotate_out(self.folder, new, step, self.keep_last)
