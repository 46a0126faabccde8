"""The iterators a resumed epoch creates again take nothing from the global RNG (FACTS 35).

Each DataLoader iterator draws one int64 when it is created, its workers' base seed (``_base_seed``), from the
loader's ``generator`` or, without one (PyTorch's tutorial and most scripts), from the global CPU stream. An
uninterrupted run creates an epoch's iterators at the epoch's start (one; two with the DDP tutorial's peek). A run
resumed mid-epoch restores the streams as the save found them, after those draws, then creates the epoch's iterators
again: one draw too many each, and every later dropout mask differs. So until the resumed epoch ends, each iterator
the loader creates draws from a private copy of the global stream's state: the same number the stream would give,
the stream itself untouched. With ``persistent_workers=True`` only the first iterator draws at all (``_reset`` does
not), so only the first one is affected.

The alternative, restoring each epoch's ``_base_seed`` exactly, buys nothing for torch's own loaders: a worker's RNG
has moved on by the save and lives in the worker process, so a resumed worker differs from the uninterrupted one
however it is seeded. torchdata's StatefulDataLoader restores ``_base_seed`` itself; for it, ``state`` hands the
restored state to every iterator of the resumed epoch (the tutorial's peek would otherwise take it, and the loop's
own iterator would start afresh).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._core.torch_compat import loader_iterator_finished, set_iterator_factory
from .stateful_loader import loader_sampler

__all__ = ["resume_iterators", "stop_resuming_iterators"]


def resume_iterators(
    loader: Any, *, epoch: int | None, first_only: bool, state: Mapping[str, Any] | None = None
) -> None:
    """Make the iterators ``loader`` creates in the resumed epoch draw nothing from the global RNG. Local.

    ``epoch``: the resumed epoch, read from the loader's sampler (``sampler.epoch``; the ``batch_sampler``'s own
    sampler where it has one) at each new iterator; the first iterator created in another epoch, or after one of
    these iterators ran to its end, is torch's own again, and so are all later ones. ``first_only``: the next iterator only (persistent workers). ``state``: a
    StatefulDataLoader's restored state, given to each of these iterators.
    """
    stop_resuming_iterators(loader)
    if loader.generator is not None and state is None:
        return  # the loader's own generator: the global stream is not drawn
    sampler = loader_sampler(loader)  # with batch_sampler=, loader.sampler is torch's default, without an epoch
    created: list[weakref.ref[Any]] = []

    def over() -> bool:
        if first_only:
            return bool(created)
        ended = any(loader_iterator_finished(it) for ref in created if (it := ref()) is not None)
        return ended or epoch is None or getattr(sampler, "epoch", None) != epoch

    def create() -> Any:
        if over():
            set_iterator_factory(loader, None)
            return original()
        if state is not None:
            loader.next_iter_state = dict(state)
        own = loader.generator
        if own is None:
            loader.generator = torch.Generator()
            loader.generator.set_state(torch.get_rng_state())
        try:
            iterator = original()
        finally:
            loader.generator = own
        created.append(weakref.ref(iterator))
        if first_only:
            set_iterator_factory(loader, None)
        return iterator

    original: Callable[[], Any] = set_iterator_factory(loader, create)


def stop_resuming_iterators(loader: Any) -> None:
    """Undo :func:`resume_iterators`: the loader creates its iterators as torch does. Local."""
    set_iterator_factory(loader, None)
