"""A save at an epoch's last batch is written once the loop has done what it does at an epoch's end.

A loop that saves every N steps saves, now and then, right after an epoch's last batch: before the work the script
does once per epoch after its batch loop (torchvision's reference: ``lr_scheduler.step()``, the EMA's warmup reset,
an evaluation, its own epoch-end save). The data position of that checkpoint says "the next epoch's start", so a run
resumed from it continues in the next epoch and never does that work: its scheduler is one step behind for the rest
of the run. So the manager holds such a save (or snapshot) and writes it when the loop moves on: just before the
registered loader creates its next iterator (the next epoch's, the DDP tutorial's peek included), at the next save or
snapshot of the same step, or at ``close()``. What it writes is the state then, which is the state an uninterrupted
run starts the next epoch with; the file has the step asked for. A save or snapshot of a later step drops a held one
(the state has moved on: writing it under the held step would be wrong). A run killed in between resumes from the
checkpoint before, and is exact. The ranks agree on holding (one all-gather of a bool), so no rank writes alone.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from .._core.log import log_rank0, logger
from .._dist.comm import all_gather_objects
from .._dist.env import is_distributed
from .._exact.data import between_epochs
from .._exact.loader_hooks import LoaderHooks
from .._exact.loaders import LoaderPosition, StatefulLoaderPosition

__all__ = ["Held", "EpochEnd"]


@dataclass(frozen=True)
class Held:
    """A save (``kind="save"``) or snapshot held until the epoch's end: the call's arguments."""

    kind: str
    step: int
    epoch: int | None
    extra: Any
    objects: Mapping[str, Any]


def _unwritten(held: Mapping[str, Held], pid: int) -> None:
    """A manager's end with a call still held (a run that never called close()): said, not written (a collective at
    exit could hang, and only the process that made the manager speaks: a forked DataLoader worker says nothing)."""
    if held and os.getpid() == pid:
        for call in held.values():
            logger.warning(
                "%s(step=%d), held at an epoch's end, was never written: the run ended without close(); call "
                "CheckpointManager.close() (or use `with`) at the end of training",
                call.kind,
                call.step,
            )


class EpochEnd:
    """The calls a manager holds at an epoch's end (see the module docstring)."""

    def __init__(self) -> None:
        self._held: dict[str, Held] = {}
        weakref.finalize(self, _unwritten, self._held, os.getpid())  # at exit too: a run that never called close()
        self._busy = False  # in hold() or writing: an iterator made meanwhile is the manager's own
        self._said = False

    def hold(
        self, call: Held, data: Any, write: Callable[[Held], None], check: Callable[[], None] | None = None
    ) -> bool:
        """Whether ``call`` is held (collective under torch.distributed when ``data`` is a loader's position, else
        local): the loop is between epochs on every rank. Held calls of another step are dropped first; ``check()``
        runs before a call is held (what the write would refuse is refused now)."""
        if self._busy:
            return False
        self.drop_older(call.step)
        if not isinstance(data, (LoaderPosition, StatefulLoaderPosition)):
            return False
        with self._busy_now():
            here = between_epochs(data)
        if not (all(all_gather_objects(here)) if is_distributed() else here):
            self._held.pop(call.kind, None)  # this call replaces it
            self.write_held(call.step, write)  # set_epoch() moved on without a new iterator: write the other now
            return False
        if check is not None:
            check()
        self._held[call.kind] = call
        self._arm(data.hooks, write)
        if not self._said:
            self._said = True
            log_rank0(
                logging.INFO,
                "%s(step=%d) comes right after an epoch's last batch: it is written when the loop starts the next "
                "epoch (after the epoch's own end: a per-epoch scheduler step, an evaluation), or at close()",
                call.kind,
                call.step,
            )
        return True

    def drop_older(self, step: int) -> None:
        """Drop held calls of another step than ``step``: the state is no longer theirs. Local."""
        for kind, held in list(self._held.items()):
            if held.step != step:
                del self._held[kind]
                logger.debug("the held %s(step=%d) is dropped: %d is saved after it", kind, held.step, step)

    def write_held(self, step: int | None, write: Callable[[Held], None]) -> None:
        """Write the held calls (of ``step`` only, unless None), the snapshot before the save. Collective as they."""
        for kind in ("snapshot", "save"):
            held = self._held.get(kind)
            if held is not None and (step is None or held.step == step):
                del self._held[kind]
                with self._busy_now():
                    write(held)

    def _arm(self, hooks: LoaderHooks, write: Callable[[Held], None]) -> None:
        """Write the held calls just before the loader of ``hooks`` creates its next iterator. The loader holds the
        manager weakly (a manager dropped without close(), as a killed process's, writes nothing more), and the hook
        holds ``hooks`` weakly (they hold it: a cycle would keep the loader's workers alive until a collection)."""
        manager_write = weakref.WeakMethod(write)  # type: ignore[arg-type]
        this, own = weakref.ref(self), weakref.ref(hooks)

        def at_next_iterator() -> None:
            epoch_end, write_now = this(), manager_write()
            if epoch_end is None or write_now is None:
                return
            if epoch_end._busy:  # the manager's own call made the iterator (a StatefulDataLoader's state_dict)
                loader_hooks = own()
                if loader_hooks is not None:
                    epoch_end._arm(loader_hooks, write_now)
                return
            epoch_end.write_held(None, write_now)

        hooks.before_next_iterator(at_next_iterator)

    @contextmanager
    def _busy_now(self) -> Iterator[None]:
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
