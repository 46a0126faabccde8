"""Exact resume: a sampler that knows how far into its epoch the job got (the per-rank state that
save_checkpoint gathers is :mod:`.rank_states`'s, re-exported here)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

from .._core import torch_compat
from .._core.errors import StateMismatchError
from .._core.log import log_rank0, logger
from .._core.rank import rank_and_world
from .rank_states import gather_rank_states, merge_rank_states
from .rng import param_device, restore_rank_rng

__all__ = [
    "PREFETCH_WARNING",
    "ResumableDistributedSampler",
    "check_sampler_state",
    "gather_rank_states",
    "merge_rank_states",
    "param_device",
    "restore_rank_rng",
]


@dataclass(frozen=True, slots=True)
class _SamplerConfig:
    num_samples: int
    num_replicas: int
    rank: int
    shuffle: bool
    seed: int
    drop_last: bool

    def __post_init__(self) -> None:
        for name in ("num_samples", "num_replicas", "rank", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        for name in ("shuffle", "drop_last"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.num_samples < 1:
            raise ValueError(f"the dataset is empty (len {self.num_samples}); a sampler needs at least one sample")
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"rank={self.rank} must be in 0..num_replicas-1 (num_replicas={self.num_replicas})")
        if self.drop_last and self.num_samples < self.num_replicas:
            raise ValueError(
                f"drop_last=True with {self.num_samples} samples and {self.num_replicas} ranks "
                "leaves every rank empty; use drop_last=False or fewer ranks"
            )


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
    current epoch is a no-op (it keeps a resumed position); another ``e`` starts that epoch afresh.

    A new iterator restarts at the epoch's resume position (the loaded one, or 0 for a fresh
    epoch), as ``DistributedSampler`` restarts each iterator: a batch peeked to learn the batch
    size (``next(iter(loader))``, as PyTorch's DDP tutorial does every epoch) costs nothing, and
    an older iterator stops once a newer one starts. The position counts what the newest iterator
    has yielded, exact for a ``DataLoader`` with ``num_workers=0``. With workers that prefetch, a
    plain ``DataLoader`` draws batches ahead of the training loop: use torchdata's
    ``StatefulDataLoader`` (it saves the position of what the loop consumed, see
    ``dist_resume._exact.stateful_loader``), or save
    ``sampler=sampler.state_dict(consumed=<samples this rank trained on in this pass>)``. The sampler
    notices when a multi-worker ``DataLoader`` draws from it and warns once, at the first
    ``state_dict()`` without ``consumed``, that the position counts prefetched samples.

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
    ) -> None:
        if num_replicas is None or rank is None:
            cur_rank, cur_world = rank_and_world()
            num_replicas = cur_world if num_replicas is None else num_replicas
            rank = cur_rank if rank is None else rank
        n = dataset if isinstance(dataset, int) and not isinstance(dataset, bool) else len(dataset)  # type: ignore[arg-type]
        self._cfg = _SamplerConfig(n, num_replicas, rank, shuffle, seed, drop_last)
        self._epoch = 0
        self._start = 0  # global position where the current pass began
        self._yielded = 0  # indices this rank yielded since then
        self._resume_at = 0  # global position a new iterator starts at: the loaded one, 0 in a fresh epoch
        self._pass = 0  # bumped by every new pass, set_epoch and load_state_dict: older iterators stop
        self._prefetching: tuple[int, int] | None = None  # (workers, prefetch) of a DataLoader drawing ahead
        self._warned_prefetch = False

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
        return min(self._start + self._yielded * self._cfg.num_replicas, self._cfg.num_samples)

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
        self._start, self._yielded = start, 0
        self._prefetching = torch_compat.drawing_loader_workers() or self._prefetching
        order = self._order(self._epoch)
        rest = order[start:]
        total = self._share(start) * w
        if total > len(rest):  # pad the final round from the start of the permutation
            rest += (order * math.ceil((total - len(rest)) / len(order)))[: total - len(rest)]
        for index in rest[self._cfg.rank : total : w]:
            if self._pass != token:
                return  # superseded by a newer pass, set_epoch or load_state_dict
            self._yielded += 1
            yield index
        if self._pass == token:
            self._epoch, self._start, self._yielded, self._resume_at = self._epoch + 1, 0, 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh; a no-op when it is the current epoch (a resumed position is kept). Local."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self._epoch:
            return
        if 0 < self.consumed < self._cfg.num_samples:
            logger.warning(
                "set_epoch(%d) abandons epoch %d after %d of %d samples",
                epoch,
                self._epoch,
                self.consumed,
                self._cfg.num_samples,
            )
        self._pass += 1
        self._epoch, self._start, self._yielded, self._resume_at = epoch, 0, 0, 0

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """Epoch and global position, plus what must match on load. Local; plain ints and bools.

        ``consumed`` overrides the position with the samples *this rank* has trained on in the
        current pass (use it when DataLoader workers prefetch ahead of the training loop).
        """
        position = self.consumed
        if consumed is None and self._prefetching is not None and not self._warned_prefetch:
            self._warned_prefetch = True
            log_rank0(logging.WARNING, PREFETCH_WARNING, *self._prefetching)
        if consumed is not None:
            if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self._yielded:
                raise ValueError(f"consumed={consumed!r} must be an int in 0..{self._yielded} (indices yielded)")
            position = min(self._start + consumed * self._cfg.num_replicas, self._cfg.num_samples)
        return {
            "epoch": self._epoch,
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
        self._pass += 1
        self._epoch, self._start, self._yielded = int(state_dict["epoch"]), int(state_dict["consumed"]), 0
        self._resume_at = self._start


PREFETCH_WARNING = (
    "ResumableDistributedSampler is drawn by a DataLoader with %d worker(s) and prefetch_factor=%d: its saved "
    "position counts the batches the workers prefetched, not only those trained on, so a resume would skip them. "
    "Use torchdata's StatefulDataLoader (exact with workers), or save "
    "sampler=sampler.state_dict(consumed=<samples this rank trained on in this pass>)"
)


def check_sampler_state(sampler: Any, state: Any, source: str = "sampler state") -> None:
    """Raise :class:`StateMismatchError` if ``state`` cannot be loaded into ``sampler``; change nothing.

    Local. Other stateful samplers (any object with ``load_state_dict``) are not checked.
    """
    if not isinstance(sampler, ResumableDistributedSampler):
        return
    if not isinstance(state, Mapping) or not {"epoch", "consumed", "num_samples"} <= set(state):
        raise StateMismatchError(f"{source}: the sampler entry is not a ResumableDistributedSampler state dict")
    for key in ("epoch", "consumed", "num_samples"):
        if isinstance(state[key], bool) or not isinstance(state[key], int) or state[key] < 0:
            raise StateMismatchError(f"{source}: sampler {key}={state[key]!r} is not a non-negative int")
    cfg = sampler._cfg
    found = {
        "num_samples": state["num_samples"],
        "seed": state.get("seed", cfg.seed),
        "shuffle": state.get("shuffle", cfg.shuffle),
    }
    wrong = [f"{k} {v!r} saved, {getattr(cfg, k)!r} now" for k, v in found.items() if v != getattr(cfg, k)]
    if wrong:
        raise StateMismatchError(
            f"{source}: the saved sampler position belongs to another permutation ({'; '.join(wrong)}); "
            "resume with the same dataset, seed and shuffle, or start the epoch afresh without the sampler"
        )
    if state["consumed"] > cfg.num_samples:
        raise StateMismatchError(
            f"{source}: sampler consumed={state['consumed']} exceeds the dataset length {cfg.num_samples}"
        )
