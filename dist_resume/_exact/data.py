"""Where a run is in its data: the object whose state is a checkpoint's data position, found in ``dataloader=``.

:func:`stateful_data` is the one place that recognises what ``dataloader=`` was given; a new kind of loader
(one that tracks what its workers prefetched, say) is recognised here and nowhere else. The plan validates a saved
position with :func:`check_data_state`, and apply restores it with the object's ``load_state_dict``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from .._core.errors import UsageError
from .._core.log import log_rank0
from .loaders import LoaderPosition, StatefulLoaderPosition
from .sampler import ResumableDistributedSampler, check_sampler_state
from .stateful_loader import is_stateful_loader

__all__ = ["stateful_data", "check_data_state", "data_sampler", "loop_epoch", "between_epochs"]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_data(dataloader: Any, *, saving: bool) -> Any:
    """The object whose ``state_dict()`` is the data position of ``dataloader`` (None for None). Local.

    - torchdata's ``StatefulDataLoader``: its own state on each rank (:class:`StatefulLoaderPosition`);
    - a ``torch.utils.data.DataLoader`` whose ``sampler`` (or ``batch_sampler.sampler``) has ``state_dict`` and
      ``load_state_dict`` (a :class:`~dist_resume.ResumableDistributedSampler`): that sampler's position, counted in
      what the loop got (:class:`LoaderPosition`);
    - a :class:`~dist_resume.ResumableDistributedSampler`, or any sampler with ``state_dict`` and
      ``load_state_dict``: the sampler itself (a loop that iterates the sampler);
    - when ``saving``, a sampler's state dict (``sampler.state_dict(consumed=n)``): saved as it is.

    Anything else raises :class:`UsageError` naming what was found and what to pass.
    """
    if dataloader is None:
        return None
    if saving and isinstance(dataloader, Mapping):
        return dataloader
    if is_stateful_loader(dataloader):  # before DataLoader: StatefulDataLoader subclasses it (FACTS 36)
        return StatefulLoaderPosition(dataloader)
    if isinstance(dataloader, DataLoader):
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        for candidate in (dataloader.sampler, getattr(batch_sampler, "sampler", None)):
            if _stateful(candidate):
                return LoaderPosition(dataloader, candidate)
        found = type(dataloader.sampler).__name__
        if batch_sampler is not None and getattr(batch_sampler, "sampler", None) is not dataloader.sampler:
            found += f" (batch_sampler {type(batch_sampler).__name__} over {type(batch_sampler.sampler).__name__})"
        raise UsageError(
            f"dataloader= is a DataLoader whose sampler is {found}, which keeps no position to save or restore",
            hint="build the DataLoader with sampler=dist_resume.ResumableDistributedSampler(dataset) (in place of "
            "shuffle=True or a DistributedSampler), or pass no dataloader= to start each epoch afresh",
        )
    if _stateful(dataloader):
        return dataloader
    what = "a DataLoader, a sampler with state_dict()/load_state_dict()" + (", or its state dict" if saving else "")
    raise UsageError(
        f"dataloader= is {type(dataloader).__module__}.{type(dataloader).__qualname__}, not {what}",
        hint="pass the DataLoader whose sampler is a dist_resume.ResumableDistributedSampler, or that sampler",
    )


def between_epochs(data: Any) -> bool:
    """Whether the loop took its epoch's last batch from ``data`` (what :func:`stateful_data` returned for a loader)
    and has not started the next epoch: the loader's next iterator is not created yet, so whatever the script does at
    an epoch's end (a per-epoch scheduler step, an EMA reset, an evaluation) is still to come. Local."""
    if not isinstance(data, (LoaderPosition, StatefulLoaderPosition)):
        return False
    sampler = data.sampler
    if not isinstance(sampler, ResumableDistributedSampler) or sampler._pass == 0:
        return False
    state = data.state_dict()
    if isinstance(data, LoaderPosition) and data.ahead is not None:  # a position ahead of the loop: no telling
        return False
    return state.get("consumed") == 0 and state.get("epoch") == sampler._pass_epoch + 1


def data_sampler(data: Any) -> Any:
    """The sampler behind what :func:`stateful_data` returned (the object itself for a sampler or a state dict)."""
    return data.sampler if isinstance(data, (LoaderPosition, StatefulLoaderPosition)) else data


def check_data_state(data: Any, state: Any, source: str) -> None:
    """Raise :class:`~dist_resume.errors.StateMismatchError` when ``state`` (a checkpoint's data position) cannot be
    restored into ``data`` (what :func:`stateful_data` returned); change nothing. Local."""
    if isinstance(data, (LoaderPosition, StatefulLoaderPosition)):
        data.check_state(state, source)
    else:
        check_sampler_state(data, state, source)


_warned_epoch = False


def loop_epoch(epoch: int | None, position: Any, data: Any) -> int | None:
    """The epoch a save records: ``epoch`` when given, else the data position's, the epoch the loop continues in
    (the one it is in, or the next once it got the epoch's last batch). Local.

    Warns once (rank 0) when ``epoch`` is the sampler's own epoch but the loop continues in another: DataLoader
    workers drew the next epoch's first indices while the loop is still in the one before, or the epoch just ended.
    """
    global _warned_epoch
    found = position.get("epoch") if isinstance(position, Mapping) else None
    found = found if isinstance(found, int) and not isinstance(found, bool) else None
    if epoch is None:
        return found
    if (
        found is not None
        and epoch != found
        and epoch == getattr(data_sampler(data), "epoch", None)
        and not _warned_epoch
    ):
        _warned_epoch = True
        log_rank0(
            logging.WARNING,
            "save(epoch=%d) records the sampler's epoch, but the loop continues in epoch %d (the data position: "
            "DataLoader workers draw ahead of the loop, and an epoch's last batch ends it): ResumeResult.epoch will "
            "say %d. Pass no epoch= to record the epoch the loop continues in",
            epoch,
            found,
            epoch,
        )
    return epoch
