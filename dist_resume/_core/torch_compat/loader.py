"""torch's DataLoader internals that dist_resume relies on (checked on torch 2.13 and torchdata 0.11): one owner.

A checkpoint's data position and the per-sample streams (:mod:`dist_resume._exact.sample_streams`) need what a
``DataLoader`` does not expose: the iterator the loop holds, the batches it handed out, the indices it sends to its
workers, and the fetch of the main process. Each item says which torch behaviour it depends on.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "drawing_loader_workers",
    "live_loader_iterator",
    "batches_yielded",
    "loader_iterator_finished",
    "set_iterator_factory",
    "map_style",
    "wrap_iterator_method",
]


def drawing_loader_workers(depth: int = 8) -> tuple[int, int] | None:
    """``(num_workers, prefetch_factor)`` of the multi-process DataLoader iterator drawing from the caller, or None.

    torch.utils.data.dataloader._MultiProcessingDataLoaderIter (torch >= 1.6) is the object whose main
    process pulls indices from the sampler, ``prefetch_factor`` batches per worker ahead of the training
    loop; it is found as ``self`` of one of the caller's ``depth`` outer frames (its ``_next_index``,
    via a BatchSampler's ``__iter__``): a sampler cannot see its DataLoader any other way. torchdata's
    StatefulDataLoader iterators are not subclasses of it (they track what the loop consumed).
    """
    try:
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
    except ImportError:  # pragma: no cover - a torch that renamed it: nothing detected
        return None
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, _MultiProcessingDataLoaderIter):
            return int(owner._num_workers), int(owner._prefetch_factor)
    return None


# torch.utils.data.DataLoader keeps the iterator of ``persistent_workers=True`` (num_workers > 0) in ``_iterator``
# (torch >= 1.7), and torchdata's StatefulDataLoader keeps its newest iterator there always; every
# ``_BaseDataLoaderIter`` counts the batches it handed to the loop in ``_num_yielded`` since its last ``_reset``
# (torch >= 1.2), and torchdata's iterators set ``_finished`` once they raised StopIteration.
def live_loader_iterator(loader: Any) -> Any:
    """The iterator ``loader`` holds on to (persistent workers, or any StatefulDataLoader's), or None."""
    return getattr(loader, "_iterator", None)


def batches_yielded(iterator: Any) -> int:
    """Batches a DataLoader iterator handed to the loop since it last (re)started."""
    return int(iterator._num_yielded)


def loader_iterator_finished(iterator: Any) -> bool:
    """Whether a StatefulDataLoader iterator ran to its end (False for torch's own iterators: they do not say)."""
    return bool(getattr(iterator, "_finished", False))


# DataLoader.__iter__ (and StatefulDataLoader's, and its state_dict() when no iterator exists) creates each
# iterator through ``self._get_iterator()`` (torch >= 1.7): a callable set on the instance is called instead,
# and deleting it restores the class's method. The iterator draws its ``_base_seed`` in ``__init__`` from
# ``loader.generator`` (the global CPU stream when it is None), before the sampler's ``__iter__`` runs.
def set_iterator_factory(loader: Any, factory: Any) -> Any:
    """Make ``loader`` create its iterators with ``factory()`` (None: torch's own method again); return torch's,
    holding the loader weakly (see :func:`_weakly_bound`)."""
    vars(loader).pop("_get_iterator", None)
    original = _weakly_bound(loader, loader._get_iterator)
    if factory is not None:
        loader._get_iterator = factory
    return original


# Each iterator (torch's and torchdata's) asks for its next indices with ``self._next_index()`` (the sampler's next
# batch, sent to a worker or fetched in the main process), hands the loop a batch with ``self._next_data()`` (then
# counts it in ``_num_yielded``) and starts a new pass with ``self._reset(loader)`` (persistent workers, each epoch):
# callables set on the instance are called instead (torch >= 1.7).
def wrap_iterator_method(iterator: Any, name: str, wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``iterator``'s method ``name`` (``_next_index``, ``_next_data``, ``_reset``) by ``wrapper(method)``,
    ``method`` holding the iterator weakly (see :func:`_weakly_bound`)."""
    setattr(iterator, name, wrapper(_weakly_bound(iterator, getattr(iterator, name))))


def _weakly_bound(owner: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """``method``, bound to ``owner`` weakly when it is one of ``owner``'s own methods.

    What replaces a loader's or an iterator's method is kept on that object (or on what it holds): the method bound
    to it strongly would be a reference cycle, which keeps a loader or an iterator the loop dropped (the DDP
    tutorial's peek, a ``break``, a run's loader when it returns) and its worker processes alive until a garbage
    collection, whose shutdown then waits torch's join timeout (5 s) for each worker.
    """
    function = getattr(method, "__func__", None)
    if function is None or getattr(method, "__self__", None) is not owner:
        return method
    ref = weakref.ref(owner)

    def weakly_bound(*args: Any, **kwargs: Any) -> Any:
        return function(ref(), *args, **kwargs)

    return weakly_bound


def map_style(loader: Any) -> bool:
    """Whether ``loader`` loads a map-style dataset by indices (``_dataset_kind``, torch >= 1.2): an
    ``IterableDataset`` draws no indices from a sampler."""
    from torch.utils.data.dataloader import _DatasetKind

    return bool(getattr(loader, "_dataset_kind", None) == _DatasetKind.Map)
