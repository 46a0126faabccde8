"""Where a run is in its data: the object whose state is a checkpoint's data position, found in ``dataloader=``.

:func:`stateful_data` is the one place that recognises what ``dataloader=`` was given; a new kind of loader
(one that tracks what its workers prefetched, say) is recognised here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch.utils.data import DataLoader

from .._core.errors import UsageError

__all__ = ["stateful_data"]


def _stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def stateful_data(dataloader: Any, *, saving: bool) -> Any:
    """The object whose ``state_dict()`` is the data position of ``dataloader`` (None for None). Local.

    - a :class:`~dist_resume.ResumableDistributedSampler`, or any sampler with ``state_dict`` and
      ``load_state_dict``: the sampler itself (a loop that iterates the sampler);
    - a ``torch.utils.data.DataLoader`` whose ``sampler`` (or ``batch_sampler.sampler``) is such a sampler:
      that sampler, saved and restored as if it were passed itself;
    - when ``saving``, a sampler's state dict (``sampler.state_dict(consumed=n)`` when DataLoader workers
      prefetch ahead of the loop): saved as it is.

    Anything else raises :class:`UsageError` naming what was found and what to pass.
    """
    if dataloader is None:
        return None
    if saving and isinstance(dataloader, Mapping):
        return dataloader
    if isinstance(dataloader, DataLoader):
        batch_sampler = getattr(dataloader, "batch_sampler", None)
        for candidate in (dataloader.sampler, getattr(batch_sampler, "sampler", None)):
            if _stateful(candidate):
                return candidate
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
