"""What dist_resume adds to a DataLoader given as ``dataloader=``: one owner for every iterator the loader creates.

:func:`hooks_of` installs it once per loader (the manager's construction, or the first ``save``/``resume`` that is
given the loader). From then on each iterator the loader creates:

- **counts the batches it hands to the loop** in its pass (:attr:`LoaderHooks.batches`), kept after the iterator is
  gone (a loop that broke out of its epoch): a plain ``DataLoader`` with workers prefetches ahead of the loop, and
  keeps no reference to its iterator without ``persistent_workers`` (FACTS 36), so without this count no checkpoint
  could tell what the loop trained on;
- **has its workers seed their global streams per sample and per batch** (``worker_init_fn``, the user's own
  first; :mod:`.sample_streams`) from the seeds a :class:`ResumableDistributedSampler` tags its indices with, so draws
  made while loading are made again after a resume (the main process's draws, ``num_workers=0``, are the training
  streams', which a checkpoint holds);
- **in a resumed epoch, draws nothing from the global RNG** (FACTS 35). Each iterator draws one int64 when it is
  created, its workers' base seed, from the loader's ``generator`` or, without one, from the global CPU stream. A run
  resumed mid-epoch restores the streams as the save found them, after those draws, then creates the epoch's
  iterators again: one draw too many each, and every later dropout mask would differ. So until the resumed epoch
  ends, each iterator takes its number from a private copy of the global stream's state (:meth:`LoaderHooks.resume`).
  torchdata's StatefulDataLoader restores its base seed itself; for it, the restored state is handed to every
  iterator of the resumed epoch (the tutorial's peek would otherwise take it, and the loop's own would start afresh).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from .._core.torch_compat.loader import (
    loader_iterator_finished,
    map_style,
    set_iterator_factory,
    wrap_iterator_method,
)
from .sample_streams import WorkerStreams
from .sampler import ResumableDistributedSampler
from .stateful_loader import loader_sampler

__all__ = ["LoaderHooks", "hooks_of"]

_ATTRIBUTE: Final = "_dist_resume_hooks"


@dataclass
class _Resuming:
    """The iterators of a resumed epoch: they draw nothing from the global RNG (see the module docstring)."""

    epoch: int | None
    first_only: bool
    state: Mapping[str, Any] | None
    created: list[weakref.ref[Any]] = field(default_factory=list)


class LoaderHooks:
    """The hooks of one loader (see the module docstring). Local."""

    def __init__(self, loader: Any) -> None:
        self._loader = weakref.ref(loader)
        self._newest: weakref.ref[Any] | None = None
        self.batches = 0  #: batches the newest iterator handed to the loop in its pass
        self.pass_token: int | None = None  #: the sampler's pass the newest iterator draws (ours only)
        self._resuming: _Resuming | None = None
        self._before_next: Callable[[], None] | None = None
        self._original: Callable[[], Any] = set_iterator_factory(loader, self._create)
        if not isinstance(loader.worker_init_fn, WorkerStreams):
            loader.worker_init_fn = WorkerStreams(loader.worker_init_fn)

    def newest(self) -> Any:
        """The newest iterator the loader created, while it lives."""
        return None if self._newest is None else self._newest()

    def before_next_iterator(self, callback: Callable[[], None] | None) -> None:
        """Call ``callback()`` once, when the loader creates its next iterator, before it does (None: no call). The
        save of an epoch's last batch is written then: the loop has done what it does at an epoch's end."""
        self._before_next = callback

    def resume(self, *, epoch: int | None, first_only: bool, state: Mapping[str, Any] | None = None) -> None:
        """Make the iterators the loader creates in the resumed epoch draw nothing from the global RNG.

        ``epoch``: the resumed epoch, read from the loader's sampler at each new iterator; the first iterator created
        in another epoch, or after one of these ran to its end, draws as torch's own do, and so do all later ones.
        ``first_only``: the next iterator only (persistent workers). ``state``: a StatefulDataLoader's restored state,
        given to each of these iterators.
        """
        loader = self._loader()
        self._resuming = None
        if loader is not None and (loader.generator is None or state is not None):
            self._resuming = _Resuming(epoch, first_only, state)
        self._newest, self.batches, self.pass_token = None, 0, None  # a restored position: no pass drawn since

    def stop_resuming(self) -> None:
        """Undo :meth:`resume`: the loader's iterators draw as torch's own do."""
        self._resuming = None
        self._newest, self.batches, self.pass_token = None, 0, None

    def _create(self) -> Any:
        callback, self._before_next = self._before_next, None
        if callback is not None:
            callback()
        loader = self._loader()
        resuming = self._resuming
        if resuming is not None and self._resumed_epoch_over(resuming, loader):
            self._resuming = resuming = None
        if resuming is None or loader is None:
            iterator = self._original()
        else:
            iterator = self._create_resumed(loader, resuming)
        self._track(iterator, loader)
        return iterator

    def _resumed_epoch_over(self, resuming: _Resuming, loader: Any) -> bool:
        if resuming.first_only:
            return bool(resuming.created)
        if any(loader_iterator_finished(it) for ref in resuming.created if (it := ref()) is not None):
            return True
        return resuming.epoch is None or getattr(loader_sampler(loader), "epoch", None) != resuming.epoch

    def _create_resumed(self, loader: Any, resuming: _Resuming) -> Any:
        if resuming.state is not None:
            loader.next_iter_state = dict(resuming.state)
        own = loader.generator
        if own is None:
            loader.generator = torch.Generator()
            loader.generator.set_state(torch.get_rng_state())
        try:
            iterator = self._original()
        finally:
            loader.generator = own
        resuming.created.append(weakref.ref(iterator))
        return iterator

    def _track(self, iterator: Any, loader: Any) -> None:
        self._newest, self.batches, self.pass_token = weakref.ref(iterator), 0, None
        if loader is None or not map_style(loader):
            return
        sampler = loader_sampler(loader)
        newest = self._newest

        def next_data(original: Callable[[], Any]) -> Callable[[], Any]:
            def counted() -> Any:
                data = original()  # StopIteration at the pass's end: not a batch
                if self._newest is newest:
                    if self.pass_token is None and isinstance(sampler, ResumableDistributedSampler):
                        self.pass_token = sampler._pass  # the pass this iterator draws: the one its count is in
                    self.batches += 1
                return data

            return counted

        def reset(original: Callable[..., Any]) -> Callable[..., Any]:
            def restarted(*args: Any, **kwargs: Any) -> Any:
                if self._newest is newest:
                    self.batches, self.pass_token = 0, None
                return original(*args, **kwargs)

            return restarted

        wrap_iterator_method(iterator, "_next_data", next_data)
        wrap_iterator_method(iterator, "_reset", reset)


def hooks_of(loader: Any) -> LoaderHooks:
    """The loader's hooks, installed on first use (idempotent). Local."""
    hooks = vars(loader).get(_ATTRIBUTE)
    if not isinstance(hooks, LoaderHooks):
        hooks = LoaderHooks(loader)
        vars(loader)[_ATTRIBUTE] = hooks
    return hooks
