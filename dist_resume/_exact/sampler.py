"""Exact resume: a sampler that knows how far into its epoch the job got."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any, Final

import torch
from torch.utils.data import Sampler

from .._core.errors import StateMismatchError
from .._core.log import log_rank0, logger
from .._core.rank import rank_and_world
from .._core.text import described
from .._core.torch_compat.loader import drawing_loader_workers
from .sample_streams import SampleIndex, stream_seed
from .sampler_config import SamplerConfig

__all__ = [
    "PREFETCH_WARNING",
    "ResumableDistributedSampler",
    "check_sampler_state",
]


class ResumableDistributedSampler(Sampler[int]):
    """A ``DistributedSampler`` that can be checkpointed mid-epoch and resumed at any world size.

    Local (no collectives). For a fresh epoch it yields exactly what ``DistributedSampler`` yields
    (same seeded permutation, rank ``r`` takes every ``num_replicas``-th index from ``r``).
    ``state_dict()`` holds the epoch and the samples consumed **globally** in it; after
    ``load_state_dict`` the rest of that epoch's permutation is split over the ranks present now,
    so with the same world size the run continues exactly, and with another one the epoch still
    ends with every sample seen once.

    Padding: only an epoch's final round, when fewer than ``num_replicas`` samples are left, is
    padded with the permutation's first samples (``drop_last=False``) or dropped
    (``drop_last=True``), as in ``DistributedSampler``. A resume adds no padding of its own: an
    interrupted epoch covers the same samples as an uninterrupted one, except that the final
    round follows the world size the epoch ends with.

    Epochs advance by themselves: when an iteration reaches the end of the epoch the sampler moves
    to the next one, so forgetting ``set_epoch`` cannot repeat a shuffle. ``set_epoch(e)`` for the
    current epoch is a no-op (it keeps a resumed position); another ``e`` starts that epoch afresh,
    except the epoch DataLoader workers just drew to its end, which restarts where its newest pass
    began (the DDP tutorial's peek can draw a resumed epoch's remainder before ``set_epoch``).

    A new iterator restarts at the epoch's resume position (the loaded one, or 0 for a fresh
    epoch), as ``DistributedSampler`` restarts each iterator: a batch peeked to learn the batch
    size (``next(iter(loader))``, as PyTorch's DDP tutorial does every epoch) is not skipped, and
    an older iterator stops once a newer one starts. The position counts what the newest iterator
    has yielded, exact for a ``DataLoader`` with ``num_workers=0``. With workers, a plain
    ``DataLoader`` draws batches ahead of the training loop: pass the ``DataLoader`` itself as
    ``dataloader=`` (its iterators then count the batches the loop got), use torchdata's
    ``StatefulDataLoader``, or save
    ``sampler=sampler.state_dict(consumed=<samples this rank trained on in this pass>)``, which counts
    in the newest pass even once the workers drew its last index and the sampler moved on. The
    sampler notices when a multi-worker ``DataLoader`` draws from it and warns once, at the first
    ``state_dict()`` without ``consumed``, that the position counts prefetched samples.

    Each index comes tagged with the seed of its sample's random streams (an ``int`` subclass, from
    ``seed``, the epoch and the index): the workers of a ``DataLoader`` given as ``dataloader=`` seed
    their global streams with it before loading the sample, so augmentation drawn there is made again
    after a resume (docs/exact-resume.md). ``sample_streams=False`` yields plain ints and leaves the
    workers' streams as torch seeds them.

    Example::

        >>> s = dist_resume.ResumableDistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
        >>> it = iter(s); first = [next(it), next(it)]; state = s.state_dict(); state["consumed"]
        4
        >>> t = dist_resume.ResumableDistributedSampler(range(10), num_replicas=1, rank=0, seed=1)
        >>> t.load_state_dict(state); len(list(t)), t.epoch   # the 6 samples the 2 ranks had left
        (6, 1)
    """

    def __init__(
        self,
        dataset: Sized | int,
        num_replicas: int | None = None,
        rank: int | None = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        sample_streams: bool = True,
    ) -> None:
        if not isinstance(sample_streams, bool):
            raise TypeError(f"sample_streams must be a bool, got {type(sample_streams).__name__} {sample_streams!r}")
        if num_replicas is None or rank is None:
            cur_rank, cur_world = rank_and_world()
            num_replicas = cur_world if num_replicas is None else num_replicas
            rank = cur_rank if rank is None else rank
        n = dataset if isinstance(dataset, int) and not isinstance(dataset, bool) else len(dataset)  # type: ignore[arg-type]
        self._cfg = SamplerConfig(n, num_replicas, rank, shuffle, seed, drop_last)
        self._epoch = 0  # the epoch the next pass draws from
        self._resume_at = 0  # global position a new pass starts at: the loaded one, 0 in a fresh epoch
        self._pass_epoch = 0  # the newest pass (kept once it ended): its epoch,
        self._start = 0  # the global position where it began,
        self._yielded = 0  # and the indices this rank yielded in it
        self._pass = 0  # bumped by every new pass, set_epoch and load_state_dict: older iterators stop
        self._prefetching: tuple[int, int] | None = None  # (workers, prefetch) of a DataLoader drawing ahead
        self._warned_prefetch = False
        #: yield each index tagged with its sample's stream seed (:mod:`.sample_streams`): draws in DataLoader workers
        self.sample_streams = sample_streams

    num_samples = property(lambda self: self._cfg.num_samples, doc="Length of the dataset.")
    num_replicas = property(lambda self: self._cfg.num_replicas, doc="Ranks sharing each epoch.")
    rank = property(lambda self: self._cfg.rank, doc="This rank's index in ``0..num_replicas-1``.")
    shuffle = property(lambda self: self._cfg.shuffle, doc="Whether each epoch is a seeded permutation.")
    seed = property(lambda self: self._cfg.seed, doc="Base seed; epoch ``e`` uses ``seed + e``.")
    drop_last = property(lambda self: self._cfg.drop_last, doc="Drop (True) or pad (False) the final round.")

    @property
    def epoch(self) -> int:
        """The epoch the next index comes from."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch consumed by all ranks together."""
        if self._pass_epoch != self._epoch:  # the newest pass ended: the epoch after it has not started
            return self._resume_at
        return self._global(self._yielded)

    def _global(self, indices: int) -> int:
        """The global position after this rank took ``indices`` indices of the newest pass."""
        return min(self._start + indices * self._cfg.num_replicas, self._cfg.num_samples)

    def _pass_length(self) -> int:
        """Indices the newest pass yields on this rank when iterated to its end."""
        return self._share(self._start)

    def _order(self, epoch: int) -> list[int]:
        if not self._cfg.shuffle:
            return list(range(self._cfg.num_samples))
        g = torch.Generator()
        g.manual_seed(self._cfg.seed + epoch)
        return torch.randperm(self._cfg.num_samples, generator=g).tolist()

    def _share(self, start: int) -> int:
        left, w = self._cfg.num_samples - start, self._cfg.num_replicas
        return left // w if self._cfg.drop_last else -(-left // w)

    def __len__(self) -> int:
        """Indices a new iterator yields: from the epoch's resume position to its end."""
        return self._share(self._resume_at)

    def __iter__(self) -> Iterator[int]:
        self._pass += 1
        token, start, w = self._pass, self._resume_at, self._cfg.num_replicas
        self._pass_epoch, self._start, self._yielded = self._epoch, start, 0
        self._prefetching = drawing_loader_workers() or self._prefetching
        order = self._order(self._epoch)
        rest = order[start:]
        total = self._share(start) * w
        if total > len(rest):  # pad the final round from the start of the permutation
            rest += (order * math.ceil((total - len(rest)) / len(order)))[: total - len(rest)]
        seed, epoch = self._cfg.seed, self._epoch
        for index in rest[self._cfg.rank : total : w]:
            if self._pass != token:
                return  # superseded by a newer pass, set_epoch or load_state_dict
            self._yielded += 1
            yield SampleIndex(index, stream_seed(seed, epoch, index)) if self.sample_streams else index
        if self._pass == token:  # the pass stays the newest (a loop may still train on what workers drew)
            self._epoch, self._resume_at = self._epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh; a no-op when it is the current epoch (a resumed position is kept). Local.

        The epoch whose last indices DataLoader workers drew ahead of the loop (the sampler moved on by itself)
        restarts where its newest pass began: the DDP tutorial's peek with workers can draw a resumed epoch's
        remainder to its end before the loop calls ``set_epoch`` for it.
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self._epoch:
            return
        if epoch == self._pass_epoch == self._epoch - 1 and self.consumed == 0:
            self._restart(epoch, self._start)
            return
        if 0 < self.consumed < self._cfg.num_samples:
            logger.warning(
                "set_epoch(%d) abandons epoch %d after %d of %d samples",
                epoch,
                self._epoch,
                self.consumed,
                self._cfg.num_samples,
            )
        self._restart(epoch, 0)

    def _restart(self, epoch: int, position: int) -> None:
        """The next pass starts at ``position`` of ``epoch``; a live iterator stops."""
        self._pass += 1
        self._epoch, self._resume_at = epoch, position
        self._pass_epoch, self._start, self._yielded = epoch, position, 0

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """The epoch and global position of the next sample, plus what must match on load. Local; plain ints and
        bools. A finished epoch is the start of the next one (``epoch + 1``, ``consumed`` 0).

        ``consumed`` overrides the position with the samples *this rank* has trained on in the newest
        pass, even when its last index was drawn already and the sampler moved to the next epoch (use it
        when DataLoader workers prefetch ahead of the training loop).
        """
        epoch, position = self._epoch, self.consumed
        if consumed is None and self._prefetching is not None and not self._warned_prefetch:
            self._warned_prefetch = True
            log_rank0(logging.WARNING, PREFETCH_WARNING, *self._prefetching)
        if consumed is not None:
            if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self._yielded:
                raise ValueError(
                    f"consumed={consumed!r} must be an int in 0..{self._yielded}: the indices this rank drew in "
                    f"the newest pass (epoch {self._pass_epoch})"
                )
            epoch, position = self._pass_epoch, self._global(consumed)
        epoch, position = self._normalized(epoch, position)
        return {
            "epoch": epoch,
            "consumed": position,
            "num_samples": self._cfg.num_samples,
            "shuffle": self._cfg.shuffle,
            "seed": self._cfg.seed,
            "drop_last": self._cfg.drop_last,
            "world_size": self._cfg.num_replicas,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict``'s epoch and position, at this sampler's world size. Local.

        Raises :class:`StateMismatchError` (changing nothing) when the dataset length, seed or
        shuffle differ, since the saved position would then point into another permutation.
        """
        check_sampler_state(self, state_dict)
        saved_world = int(state_dict.get("world_size", self._cfg.num_replicas))
        if saved_world != self._cfg.num_replicas:
            log_rank0(
                logging.INFO,
                "sampler: epoch %d resumes at sample %d of %d with %d rank(s) instead of %d; "
                "the rest of the epoch is split over the new ranks",
                state_dict["epoch"],
                state_dict["consumed"],
                self._cfg.num_samples,
                self._cfg.num_replicas,
                saved_world,
            )
        self._restart(*self._normalized(int(state_dict["epoch"]), int(state_dict["consumed"])))

    def _normalized(self, epoch: int, position: int) -> tuple[int, int]:
        """``(epoch + 1, 0)`` for a position with nothing left to yield, so that a peek (``next(iter(loader))``)
        after a resume finds the next epoch's first batch, as it does in an uninterrupted run."""
        return (epoch + 1, 0) if self._share(position) == 0 else (epoch, position)


PREFETCH_WARNING = (
    "ResumableDistributedSampler is drawn by a DataLoader with %d worker(s) and prefetch_factor=%d: its own "
    "position counts the batches the workers prefetched, not only those trained on, so a resume would skip them. "
    "Pass the DataLoader itself as dataloader=, built with persistent_workers=True (exact), use torchdata's "
    "StatefulDataLoader (exact), or save dataloader=sampler.state_dict(consumed=<samples this rank trained on in "
    "this pass>) (CheckpointManager.save: sampler=...)"
)


def check_sampler_state(sampler: Any, state: Any, source: str = "sampler state") -> None:
    """Raise :class:`StateMismatchError` if ``state`` cannot be loaded into ``sampler``; change nothing.

    Local. Other stateful samplers (any object with ``load_state_dict``) are not checked.
    """
    if not isinstance(sampler, ResumableDistributedSampler):
        return
    if not isinstance(state, Mapping) or not {"epoch", "consumed", "num_samples"} <= set(state):
        raise StateMismatchError(f"{source}: the sampler entry is not a ResumableDistributedSampler state dict")
    cfg = sampler._cfg
    # each entry typed before it is compared or converted (``!=`` of a tensor is a tensor; int() of NaN raises)
    for key in _FIELDS:
        if key in state and (what := _field_problem(key, state[key])) is not None:
            raise StateMismatchError(
                f"{source}: sampler {key}={described(state[key], 60)} is not {what}; the checkpoint is damaged or was "
                "edited: resume from another checkpoint, or start the epoch afresh without the sampler"
            )
    found = {
        "num_samples": state["num_samples"],
        "seed": state.get("seed", cfg.seed),
        "shuffle": state.get("shuffle", cfg.shuffle),
    }
    wrong = [f"{k} {described(v)} saved, {getattr(cfg, k)!r} now" for k, v in found.items() if v != getattr(cfg, k)]
    if wrong:
        raise StateMismatchError(
            f"{source}: the saved sampler position belongs to another permutation ({'; '.join(wrong)}); "
            "resume with the same dataset, seed and shuffle, or start the epoch afresh without the sampler"
        )
    if state["consumed"] > cfg.num_samples:
        raise StateMismatchError(
            f"{source}: sampler consumed={state['consumed']} exceeds the dataset length {cfg.num_samples}"
        )


_COUNTS: Final = ("epoch", "consumed", "num_samples")
_FIELDS: Final = (*_COUNTS, "seed", "world_size", "shuffle", "drop_last")  # what state_dict() writes
_MAX_INT: Final = (1 << 63) - 1


def _field_problem(key: str, value: Any) -> str | None:
    """What the sampler state's ``key`` must be and ``value`` is not, or None."""
    if key in ("shuffle", "drop_last"):
        return None if isinstance(value, bool) else "a bool"
    low = 0 if key in _COUNTS else 1 if key == "world_size" else None  # the seed: any int
    if type(value) is not int or (low is not None and not low <= value <= _MAX_INT):
        return "an int" if low is None else f"{'a positive' if low else 'a non-negative'} int within int64"
    return None
