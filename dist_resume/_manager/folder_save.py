"""One save into a checkpoint folder: the checkpoint's name, the writer's preparation, the write, then rotation.

:meth:`CheckpointManager.save` and :meth:`~CheckpointManager.save_async` are the public face (docs/architecture.md's
save path); this module holds their steps: the path named from the step (a file ``ckpt_<step>.pt``, or the sharded
checkpoint folder ``ckpt_<step>.dcp`` of an FSDP2 model), the previous asynchronous save waited for, rank 0 taking
the folder's write lock and removing leftovers of interrupted saves, the collective payload, the write (now, or in a
background thread), and rotation once the new checkpoint is durable.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._checkpoint.objects import LiveObjects
from .._core.location import Location
from .._dist.comm import run_on_rank0
from .._save.async_save import AsyncSave, wait_pending, write_in_background
from .._save.save import prepare_payload, write_checkpoint
from .._save.saveable import check_count, check_saveable
from .._save.sharded import writes_folder
from .._source.listing import checkpoint_name, sharded_checkpoint_name
from .lease import PrefixLease
from .lock import FolderLock
from .rotation import remove_leftovers, rotate_out

__all__ = ["SaveTarget", "save_into", "save_into_async"]


@dataclass(frozen=True)
class SaveTarget:
    """Where and how a manager saves: its folder, the folder's write lock, ``keep_last`` and ``full_state``."""

    folder: Location
    lock: FolderLock | PrefixLease
    keep_last: int
    full_state: bool

    def path(self, live: LiveObjects, step: int) -> Location:
        """``ckpt_<step>.pt``, or ``ckpt_<step>.dcp`` for the sharded checkpoint folder of an FSDP2 model."""
        folder = writes_folder(live.model, self.full_state)
        return self.folder / (sharded_checkpoint_name if folder else checkpoint_name)(_check_step(step))

    def file(self, step: int) -> Location:
        """``ckpt_<step>.pt``: the file a snapshot of ``step`` is copied into."""
        return self.folder / checkpoint_name(_check_step(step))

    def prepare(self) -> None:
        """On the writing rank: the lock, before anything is written or removed; then the leftovers."""
        self.lock.acquire()
        remove_leftovers(self.folder)

    def rotate(self, new: Location, step: int) -> None:
        rotate_out(self.folder, new, step, self.keep_last)


def _check_step(step: Any) -> int:
    if type(step) is not int:
        raise ValueError(f"step must be a non-negative int (it names the file), got {step!r}")
    check_count("step", step, " (it names the file)")
    return step


def _begin(
    target: SaveTarget, live: LiveObjects, step: int, epoch: int | None, extra: Any, where: str
) -> tuple[Location, Callable[[], dict[str, Any]], int | None, float]:
    """The steps both saves share: the path, the previous save waited for, the writer prepared, the payload; and
    when this save began (after the wait: the log line's time is this save's own)."""
    path = target.path(live, step)
    check_saveable(live, step=step, epoch=epoch, extra=extra, where=f"CheckpointManager.{where}()")
    wait_pending()  # the previous save's temporary file must not be mistaken for a stale one
    started = time.perf_counter()
    run_on_rank0(target.prepare)
    build, epoch = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True)
    return path, build, epoch, started


def save_into(target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any) -> Location:
    """Save ``live`` as the checkpoint of ``step`` into the target's folder, then rotate; return its path.
    Collective under torch.distributed (see :meth:`CheckpointManager.save`)."""
    path, build, epoch, started = _begin(target, live, step, epoch, extra, "save")
    write_checkpoint(
        path, build, step=step, epoch=epoch, model=live.model, full_state=target.full_state, started=started
    )
    run_on_rank0(lambda: target.rotate(path, step))
    return path


def save_into_async(target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any) -> AsyncSave:
    """Like :func:`save_into`, the write and the rotation in a background thread once the state is snapshotted.
    Collective under torch.distributed (see :meth:`CheckpointManager.save_async`)."""
    path, build, epoch, started = _begin(target, live, step, epoch, extra, "save_async")
    return write_in_background(
        path,
        build,
        step=step,
        epoch=epoch,
        after_write=lambda done: target.rotate(done, step),
        model=live.model,
        full_state=target.full_state,
        started=started,
    )
