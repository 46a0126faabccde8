"""A DataLoader's data position: the object ``dataloader=`` becomes (:func:`~dist_resume._exact.data.stateful_data`).

Both kinds have ``state_dict()`` (this rank's position, gathered with its RNG state at a save), ``check_state``
(validation, changes nothing: the plan calls it) and ``load_state_dict`` (a checkpoint's position, or what
``state_dict()`` returned), and install the loader's hooks (:mod:`.loader_hooks`: the count of what the loop got,
per-sample streams, iterators of a resumed epoch that draw nothing from the global RNG).

- :class:`LoaderPosition`, torch's ``DataLoader`` over a :class:`ResumableDistributedSampler`. With
  ``num_workers=0`` the sampler's position is what the loop trained on. With workers, persistent or not, the
  loader's hooks (:mod:`.loader_hooks`) count the batches its newest iterator handed to the loop in the sampler's
  newest pass, even once the workers drew that pass to its end and the sampler moved on: that count is the position.
  Batches that cannot be counted in samples (a ``batch_sampler`` of the user's own, ``in_order=False``) leave the
  sampler's own position, ahead by the prefetched batches: the first save warns (rank 0, once).
- :class:`StatefulLoaderPosition`, torchdata's ``StatefulDataLoader``: each rank's own state
  (:mod:`.stateful_loader`), under the position's ``"loader"`` key, next to the sampler's exact position.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, Final

from torch.utils.data import BatchSampler, DataLoader

from .._core.errors import StateMismatchError
from .._core.log import log_rank0
from .._core.torch_compat.loader import batches_yielded, live_loader_iterator
from .loader_hooks import hooks_of
from .sampler import ResumableDistributedSampler, check_sampler_state
from .stateful_loader import (
    LoaderRestore,
    RestoreMode,
    check_loader_state,
    is_stateful_loader,
    loader_position,
    loader_sampler,
    loader_state,
    restore_loader,
)

__all__ = ["LoaderPosition", "StatefulLoaderPosition", "prefetch_warning", "warn_prefetch_once"]

_NO_ITERATOR: Final = (
    "dataloader= is a DataLoader with %d worker(s) and prefetch_factor=%d whose iterator was created before "
    "dist_resume was given the loader, and it keeps no reference to it (persistent_workers=False), so this save "
    "cannot see what the loop trained on: the saved position counts the batches the workers prefetched too, and a "
    "resume would skip them. Give the loader to dist_resume before iterating it (CheckpointManager(dataloader=...), "
    "or resume(..., dataloader=...) before the loop: from its next iterator on the position is exact), build it "
    "with persistent_workers=True, use torchdata's StatefulDataLoader, or save "
    "dataloader=sampler.state_dict(consumed=<samples this rank trained on in this pass>) "
    "(CheckpointManager.save: sampler=...)"
)
_UNCOUNTED: Final = (
    "the DataLoader's batches cannot be counted in samples (a batch_sampler other than torch's BatchSampler, or "
    "in_order=False): its saved position counts the batches its %d worker(s) prefetched, so a resume would skip "
    "them. Use torch's BatchSampler (batch_size=) with in_order=True, or torchdata's StatefulDataLoader"
)

_UNTRACKED: Final = (
    "dataloader= is a StatefulDataLoader whose batch_sampler (%s) has no state_dict() and is no torch BatchSampler: "
    "neither torchdata nor dist_resume can tell where in the epoch the loop is, so a resume may replay or skip "
    "batches. Use torch's BatchSampler (or batch_size=), or give the batch sampler state_dict()/load_state_dict()"
)


def _persistent(loader: Any) -> bool:
    return loader.num_workers > 0 and bool(loader.persistent_workers)


def _batching(loader: DataLoader[Any]) -> tuple[int, bool] | None:
    """(batch size, drop_last) of the batches ``loader`` makes of its sampler's indices; None when not countable."""
    if not getattr(loader, "in_order", True):
        return None
    if loader.batch_size is not None:
        return loader.batch_size, loader.drop_last
    if loader.batch_sampler is None:
        return 1, False
    if isinstance(loader.batch_sampler, BatchSampler):
        return loader.batch_sampler.batch_size, loader.batch_sampler.drop_last
    return None


def prefetch_warning(loader: Any) -> str | None:
    """The warning for a plain ``DataLoader`` whose workers prefetch from a ``ResumableDistributedSampler`` where a
    save may not see what the loop trained on, or None (``num_workers=0``, persistent workers). Local: batches that
    cannot be counted in samples, or (the caller decides when) an iterator created before dist_resume saw the loader.
    """
    if loader.num_workers == 0 or is_stateful_loader(loader):
        return None
    if not isinstance(loader_sampler(loader), ResumableDistributedSampler):
        return None
    if _batching(loader) is None:
        return _UNCOUNTED % int(loader.num_workers)
    if _persistent(loader):
        return None
    return _NO_ITERATOR % (int(loader.num_workers), int(loader.prefetch_factor or 2))


def warn_prefetch_once(loader: Any) -> None:
    """Log :func:`prefetch_warning` (WARNING, rank 0) the first time for this loader's sampler; never again for it,
    nor when the sampler noticed the workers itself. Local."""
    text = prefetch_warning(loader)
    sampler = loader_sampler(loader)
    if text is None or sampler._warned_prefetch:
        return
    sampler._warned_prefetch = True
    log_rank0(logging.WARNING, "%s", text)


def _trained(sampler: ResumableDistributedSampler, batches: int, size: int, drop_last: bool) -> int:
    """Indices of the sampler's newest pass in the first ``batches`` batches of ``size`` (all of them, the dropped
    last indices included, once the loop got every batch)."""
    length = sampler._pass_length()
    total = length // size if drop_last else -(-length // size)
    return length if batches >= total else batches * size


def _counted(sampler: ResumableDistributedSampler, batches: int, batching: tuple[int, bool]) -> dict[str, Any]:
    """The sampler's state at the ``batches`` its newest pass's iterator handed to the loop, counted in samples."""
    trained = _trained(sampler, batches, *batching)
    if trained > sampler._yielded:  # set_epoch or load_state_dict since the iterator's pass: that position
        return sampler.state_dict()
    return sampler.state_dict(consumed=trained)


def _untracked(loader: Any) -> bool:
    """Whether torchdata keeps no sampler state for ``loader``: a ``batch_sampler`` without ``state_dict`` (torch's
    own ``BatchSampler``), which torchdata can only fast-forward, in a sampler whose epoch it does not know."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    return batch_sampler is not None and not callable(getattr(batch_sampler, "state_dict", None))


class LoaderPosition:
    """The data position of torch's ``DataLoader`` over a stateful sampler (see the module docstring)."""

    def __init__(self, loader: DataLoader[Any], sampler: Any) -> None:
        self.loader = loader
        self.sampler = sampler
        self.hooks = hooks_of(loader)
        #: the WARNING's text when the newest :meth:`state_dict` counts batches the workers prefetched, else None
        self.ahead: str | None = None

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: the sampler's state dict, counted in what the loop got. Local."""
        self.ahead = None
        loader, sampler = self.loader, self.sampler
        if not isinstance(sampler, ResumableDistributedSampler):
            return dict(sampler.state_dict())
        batching = _batching(loader)
        if loader.num_workers == 0:
            return sampler.state_dict()  # the main process loads: the sampler gave out what the loop got
        if batching is not None and self.hooks.pass_token == sampler._pass:  # the newest pass is counted
            sampler._warned_prefetch = True  # the loop's count is the position: nothing for the sampler to say
            return _counted(sampler, self.hooks.batches, batching)
        live = live_loader_iterator(loader)
        if batching is not None and live is not None:  # persistent workers started before the loader was given
            sampler._warned_prefetch = True
            return _counted(sampler, batches_yielded(live), batching)
        if sampler._yielded > 0 and (batching is None or sampler._prefetching is not None):  # workers drew ahead
            self.ahead = prefetch_warning(loader)
            warn_prefetch_once(loader)
        return sampler.state_dict()

    def check_state(self, state: Any, source: str) -> None:
        """Raise :class:`StateMismatchError` when ``state`` cannot be loaded; change nothing. Local."""
        check_sampler_state(self.sampler, state, source)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state``: the sampler's position, and the resumed epoch's iterators. Local."""
        loader, sampler, hooks = self.loader, self.sampler, self.hooks
        sampler.load_state_dict(state)
        if not isinstance(sampler, ResumableDistributedSampler) or live_loader_iterator(loader) is not None:
            hooks.stop_resuming()
        elif _persistent(loader) and (sampler.epoch, sampler.consumed) != (0, 0):  # its one iterator existed then
            hooks.resume(epoch=None, first_only=True)
        elif not _persistent(loader) and sampler.consumed > 0:  # mid-epoch: that epoch's iterators existed at the save
            hooks.resume(epoch=sampler.epoch, first_only=False)
        else:
            hooks.stop_resuming()


class StatefulLoaderPosition:
    """The data position of torchdata's ``StatefulDataLoader``: each rank's own state (see the module docstring)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.sampler = loader_sampler(loader)
        self.hooks = hooks_of(loader)

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: ``{"loader": its entry}`` and the sampler's position at the top. Local."""
        loader = self.loader
        if live_loader_iterator(loader) is not None:
            entry = loader_state(loader)
        else:  # never iterated, or restored and not iterated since: no iterator (nor worker) started for a save
            entry = loader_state(loader, loader.next_iter_state or {})
        position = loader_position(entry)
        sampler = self.sampler
        if position is None and isinstance(sampler, ResumableDistributedSampler):
            iterator, batching = live_loader_iterator(loader), _batching(loader)
            if not entry["state"]:
                position = sampler.state_dict()
            elif _untracked(loader) and iterator is not None and batching is not None:
                position = _counted(sampler, batches_yielded(iterator), batching)
            elif _untracked(loader) and not sampler._warned_prefetch:
                sampler._warned_prefetch = True
                log_rank0(logging.WARNING, _UNTRACKED, type(loader.batch_sampler).__name__)
        return {**(position if position is not None else {"epoch": entry["epoch"]}), "loader": entry}

    def check_state(self, state: Any, source: str) -> None:
        """Raise :class:`StateMismatchError` when ``state`` cannot be loaded; change nothing. Local."""
        self._plan(state, source)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (every rank's entries, or this rank's from :meth:`state_dict`). Local."""
        restore = self._plan(state, "the dataloader state")
        restore_loader(restore)
        loader, position, hooks = self.loader, restore.position, self.hooks
        if restore.mode is RestoreMode.SAMPLER or not restore.state:
            if position is not None and position["consumed"] > 0:
                hooks.resume(epoch=position["epoch"], first_only=_persistent(loader))
            else:
                hooks.stop_resuming()
        elif _persistent(loader):
            hooks.resume(epoch=None, first_only=True)
        else:  # every iterator of the resumed epoch starts from the state (the tutorial's peek takes one)
            hooks.resume(epoch=getattr(self.sampler, "epoch", None), first_only=False, state=restore.state)

    def _plan(self, state: Any, source: str) -> LoaderRestore:
        if not isinstance(state, Mapping):
            raise StateMismatchError(f"{source}: the data position is {type(state).__name__}, not a state dict")
        saved = state.get("loader")
        if saved is None:  # saved from a plain DataLoader or a sampler: the sampler's position only
            check_sampler_state(self.sampler, state, source)
            if not isinstance(self.sampler, ResumableDistributedSampler):
                raise StateMismatchError(
                    f"{source} holds a sampler position but no StatefulDataLoader state, and this loader's sampler "
                    f"is a {type(self.sampler).__name__}; resume without dataloader= to start the epoch afresh"
                )
            position = self.sampler._normalized(int(state["epoch"]), int(state["consumed"]))
            position_state = {**state, "epoch": position[0], "consumed": position[1]}
            return LoaderRestore(self.loader, RestoreMode.SAMPLER, position_state, None, None, position_state)
        if isinstance(saved, Mapping):  # this rank's own entry, from state_dict()
            saved = [saved] * int(saved.get("world_size") or 1)
        counted = {k: v for k, v in state.items() if k != "loader"} if _untracked(self.loader) else None
        restore = check_loader_state(
            self.loader, saved, source=source, counted=counted if "consumed" in state else None
        )
        if restore.mode is RestoreMode.FULL and not restore.state and "consumed" in state:  # had not iterated
            check_sampler_state(self.sampler, state, source)
            position_state = {key: value for key, value in state.items() if key != "loader"}
            restore = LoaderRestore(self.loader, RestoreMode.FULL, {}, restore.epoch, None, position_state)
        return restore
