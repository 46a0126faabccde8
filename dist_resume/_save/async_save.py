"""Asynchronous saves: the handle of a write in a background thread (one pending at a time), and the writes: rank 0's
file from a snapshot (:mod:`.staging`), a striped save's shares and an FSDP2 model's shards, every rank in a thread of
its own on a second gloo group."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.errors import CheckpointWriteError
from .._core.exit import wait_at_exit
from .._core.location import Location
from .._core.log import log_saved
from .._dist.accelerator import synchronize
from .._dist.comm import run_on_rank0
from .._dist.env import is_distributed
from .._dist.groups import gloo_group
from .._format.atomic import atomic_write
from .._state.sharded import is_sharded
from .full_state import save_full
from .save import tell
from .sharded import ShardedSave, begin_sharded, finish_sharded
from .staging import stage
from .striped import begin_striped, stripes

__all__ = ["AsyncSave", "write_in_background", "finish_sharded_in_background", "wait_pending"]

_pending: AsyncSave | None = None
_pending_lock = threading.Lock()


class AsyncSave:
    """Handle of a checkpoint being written in the background by :func:`save_checkpoint_async`."""

    def __init__(self, path: Location, thread: threading.Thread | None, *, every_rank: bool = False) -> None:
        self.path = path
        self._thread = thread
        self._every_rank = every_rank  # a sharded save: every rank writes in a thread of its own
        self._error: BaseException | None = None
        self._outcome: tuple[Location | None, BaseException | None] | None = None

    def _start(self, write: Callable[[], None]) -> None:
        """Run ``write`` in a thread; its error, if any, is what :meth:`wait` raises (on every rank)."""

        def run() -> None:
            try:
                write()
            except CheckpointWriteError as err:
                self._error = err
            except Exception as err:  # surfaced by wait() on every rank
                self._error = CheckpointWriteError(
                    f"background save of {str(self.path)!r} failed: {type(err).__name__}: {err}"
                )

        self._thread = threading.Thread(target=run, name=f"dist_resume-save-{self.path.name}", daemon=False)
        self._thread.start()
        wait_at_exit(self._thread)  # a script that ends first: the write completes before a lease is released

    def done(self) -> bool:
        """True once the background write has finished (successfully or not). Local."""
        return self._thread is None or not self._thread.is_alive()

    @property
    def waited(self) -> bool:
        """True once :meth:`wait` has returned or raised (its outcome was delivered). Local."""
        return self._outcome is not None

    def _join(self) -> Location:
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self.path

    def wait(self) -> Location:
        """Block until the checkpoint is durable; return its path or raise the write's error.

        Collective under torch.distributed (rank 0 reports its outcome to every rank): call it on
        every rank. Later calls return (or raise) the same outcome at once, locally.
        """
        global _pending
        if self._outcome is None:
            with _pending_lock:
                if _pending is self:
                    _pending = None
            try:
                if self._every_rank and self._thread is not None:
                    self._thread.join()  # this rank's part; its outcome is the one every rank agreed on
                self._outcome = (run_on_rank0(self._join), None)
            except Exception as err:
                self._outcome = (None, err)
        path, error = self._outcome
        if error is not None:
            raise error
        assert path is not None
        return path


def wait_pending() -> Location | None:
    """Wait for the previous asynchronous save, if any (collective like :meth:`AsyncSave.wait`)."""
    with _pending_lock:
        pending = _pending
    return pending.wait() if pending is not None else None


_background: tuple[Any, Any] = (None, None)  # (the default process group, the second group made for it)


def _background_group() -> Any:
    """A gloo process group of every rank for the writes of background threads (collective the first time)."""
    global _background
    if _background[0] is not dist.group.WORLD:
        _background = (dist.group.WORLD, gloo_group())
    return _background[1]


_IN_BACKGROUND = ", in the background"  # what the save's log line adds after its time


def _sharded_in_background(
    dest: Location,
    build: Callable[[], dict[str, Any]],
    model: nn.Module,
    *,
    step: Any,
    epoch: Any,
    after: Any,
    started: float,
) -> AsyncSave:
    begun = begin_sharded(dest, build, model, step=step, epoch=epoch, started=started)
    return _finish_in_background(begun.staged(), after)


def _finish_in_background(begun: ShardedSave, after: Callable[[Location], None] | None) -> AsyncSave:
    save = dataclasses.replace(begun, how=_IN_BACKGROUND)
    group = _background_group()
    handle = AsyncSave(save.dest, None, every_rank=True)

    def write() -> None:
        finish_sharded(save, group)
        if after is not None:
            after(save.dest)

    handle._start(write)
    return handle


def finish_sharded_in_background(begun: ShardedSave, after: Callable[[Location], None] | None = None) -> AsyncSave:
    """Every rank writes the begun sharded save ``begun`` in a thread of its own (its tensors must stay as they are
    until the handle is done: an FSDP2 snapshot in shared memory, which the next snapshot waits for), the collectives
    on the second gloo group, then runs ``after(dest)`` (every rank). Collective (the group, made the first time);
    waits for the previous asynchronous save first, and is the one :func:`wait_pending` waits for."""
    global _pending
    wait_pending()
    handle = _finish_in_background(begun, after)
    with _pending_lock:
        _pending = handle
    return handle


def _striped_in_background(
    dest: Path,
    build: Callable[[], dict[str, Any]],
    model: nn.Module,
    *,
    step: Any,
    epoch: Any,
    after: Any,
    started: float,
) -> AsyncSave | None:
    """Every rank snapshots its own share of a striped save and writes it in a thread; the gather of the CRCs and
    rank 0's commit run there on the second gloo group. None when some rank cannot see the folder."""
    group = _background_group()  # collective the first time: every rank, now, before any thread uses it
    begun = begin_striped(dest, build, model, step=step, epoch=epoch, started=started)
    if begun is None:
        return None
    data, queued = stage([tensor for _, tensor in begun.items])
    synchronize(queued)  # the non-blocking copies must land before the thread reads them
    save = begun.with_data(data, _IN_BACKGROUND)
    handle = AsyncSave(dest, None, every_rank=True)

    def write() -> None:
        save.write()
        save.finish(group)
        if after is not None and dist.get_rank() == 0:
            after(dest)

    handle._start(write)
    return handle


def write_in_background(
    path: Location,
    build: Callable[[], dict[str, Any]],
    *,
    step: int | None,
    epoch: int | None = None,
    after_write: Callable[[Location], None] | None = None,
    model: nn.Module | None = None,
    full_state: bool = False,
    started: float | None = None,
) -> AsyncSave:
    """Rank 0 snapshots ``build()``'s payload and a thread writes it atomically, then runs ``after_write`` (e.g.
    rotation) once the file is durable. Local; the caller has waited for the previous save (:func:`wait_pending`).
    An FSDP2 ``model``: collective, every rank writes its shards in a thread (``full_state``: one file, now).
    Rank 0 logs the save's line once the write is durable, its time counted from ``started`` (a
    ``time.perf_counter()``; this call's start when None)."""
    global _pending
    began = time.perf_counter() if started is None else started
    dest = path
    if model is not None and is_sharded(model):
        if full_state:
            written = save_full(dest, build, step=step, epoch=epoch, started=began)
            if after_write is not None:
                run_on_rank0(lambda: after_write(written))
            handle = AsyncSave(written, None)
        else:
            rank0_after = None if after_write is None or dist.get_rank() != 0 else after_write
            handle = _sharded_in_background(
                dest, build, model, step=step, epoch=epoch, after=rank0_after, started=began
            )
    elif (
        model is not None
        and isinstance(dest, Path)
        and is_distributed()
        and stripes(model, dest, dist.get_world_size())
        and (
            striped := _striped_in_background(
                dest, build, model, step=step, epoch=epoch, after=after_write, started=began
            )
        )
        is not None
    ):
        handle = striped
    elif not is_distributed() or dist.get_rank() == 0:
        snapshot, queued = stage(build())
        synchronize(queued)  # the non-blocking copies must land before the thread reads them
        handle = AsyncSave(dest, None)

        def write() -> None:
            size: list[int | None] = [None]

            def dump(f: Any) -> None:
                torch.save(snapshot, f)
                size[0] = tell(f)

            atomic_write(dest, dump)
            seconds = time.perf_counter() - began
            log_saved(dest, step=step, epoch=epoch, size=size[0], seconds=seconds, how=_IN_BACKGROUND)
            if after_write is not None:
                after_write(dest)

        handle._start(write)
    else:
        handle = AsyncSave(dest, None)
    with _pending_lock:
        _pending = handle
    return handle
