"""Exact resume: each rank's RNG streams, and a sampler that knows how far into its epoch the job got."""

from __future__ import annotations

import hashlib
import logging
import math
import random
from collections.abc import Iterator, Mapping, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from ._env import is_distributed, rank_info
from ._errors import StateMismatchError
from ._log import log_rank0, logger

__all__ = ["ResumableDistributedSampler", "rng_state_dict", "load_rng_state_dict", "seed_rng", "derive_seed",
           "gather_rank_states", "merge_rank_states", "restore_rank_rng", "check_sampler_state", "param_device"]

_base_seed: int | None = None  # the seed last given to seed_rng(); stored so new ranks can derive from it


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    info = rank_info()
    return info.rank, info.world_size


def param_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (``cpu`` for an empty model): the rank's device."""
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def derive_seed(seed: int, rank: int = 0, step: int = 0) -> int:
    """A 63-bit seed for ``rank`` at ``step``, a pure function of its arguments. Local.

    Example::

        >>> dist_resume.derive_seed(0, rank=1) == dist_resume.derive_seed(0, rank=1) != dist_resume.derive_seed(0)
        True
    """
    digest = hashlib.sha256(f"dist_resume:{int(seed)}:{int(rank)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_rng(seed: int, *, rank: int | None = None, step: int = 0, device: torch.device | str | None = None) -> int:
    """Seed python ``random``, torch's CPU generator, ``device``'s CUDA generator and numpy for this rank.

    Local. Each rank gets its own stream, ``derive_seed(seed, rank, step)`` (``rank`` defaults to
    this process's global rank); returns that derived seed. Build the model *before* calling it
    (after ``torch.manual_seed(seed)``) so every rank starts from the same weights.

    Example::

        >>> dist_resume.seed_rng(1234, rank=0) == dist_resume.derive_seed(1234, 0)
        True
    """
    global _base_seed
    if rank is None:
        rank = _rank_world()[0]
    derived = derive_seed(seed, rank, step)
    random.seed(derived)
    torch.default_generator.manual_seed(derived)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        with torch.cuda.device(dev):
            torch.cuda.manual_seed(derived)  # this rank's device only
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(derived % 2**32)
    _base_seed = int(seed)
    return derived


def rng_state_dict(device: torch.device | str | None = None) -> dict[str, Any]:
    """This process's RNG streams: python ``random``, torch CPU, ``device``'s CUDA stream, numpy.

    Local. Only the CUDA generator of ``device`` is read (never ``get_rng_state_all``, which
    initialises every visible GPU); numpy's state is stored as a tensor and plain numbers, so the
    result loads under ``torch.load(weights_only=True)``. numpy is skipped when not installed.

    Example::

        >>> state = dist_resume.rng_state_dict("cpu")
        >>> a = torch.rand(1); dist_resume.load_rng_state_dict(state, "cpu"); torch.equal(a, torch.rand(1))
        True
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None,
        "numpy": None,
        "seed": _base_seed if _base_seed is not None else torch.initial_seed(),
    }
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state["numpy"] = {"bit_generator": str(name), "keys": torch.from_numpy(keys.astype(np.int64)),
                      "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def load_rng_state_dict(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Restore what :func:`rng_state_dict` captured. Local.

    A CUDA state is applied to ``device`` only; when this process has no CUDA device (or numpy is
    not installed) that part is skipped with a WARNING, never silently.

    Example::

        >>> dist_resume.load_rng_state_dict(dist_resume.rng_state_dict())
    """
    if not isinstance(state, Mapping) or not {"python", "torch"} <= set(state):
        raise StateMismatchError(
            f"RNG state must be a mapping with 'python' and 'torch' entries (from rng_state_dict()), got "
            f"{type(state).__name__} with keys {sorted(state) if isinstance(state, Mapping) else '-'}"
        )
    dev = torch.device(device) if device is not None else torch.device("cpu")
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    cuda = state.get("cuda")
    if cuda is not None:
        if dev.type == "cuda":
            torch.cuda.set_rng_state(cuda.to("cpu", torch.uint8), dev)
        else:
            logger.warning("the saved CUDA RNG state is not restored: this process runs on %s", dev)
    saved_np = state.get("numpy")
    if saved_np is not None:
        try:
            import numpy as np
        except ImportError:
            logger.warning("the saved numpy RNG state is not restored: numpy is not installed")
            return
        np.random.set_state((saved_np["bit_generator"], saved_np["keys"].numpy().astype(np.uint32),
                             saved_np["pos"], saved_np["has_gauss"], saved_np["cached_gaussian"]))


def gather_rank_states(*, rng: bool, sampler: Any = None,
                       device: torch.device | None = None) -> list[dict[str, Any]] | None:
    """Every rank's RNG and sampler state, gathered on rank 0 (``None`` on the others).

    Collective under torch.distributed (one ``gather_object``): call it on every rank. Local in a
    single process.
    """
    mine = {"rng": rng_state_dict(device) if rng else None,
            "sampler": dict(sampler.state_dict()) if sampler is not None else None}
    if not is_distributed():
        return [mine]
    rank, world = _rank_world()
    out: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def merge_rank_states(states: list[dict[str, Any]]) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """The checkpoint's RNG list (index = rank) and sampler state from :func:`gather_rank_states`.

    Raises :class:`StateMismatchError` when the ranks' samplers disagree on epoch or position.
    """
    rngs = [s["rng"] for s in states]
    samplers = [s["sampler"] for s in states]
    sampler = samplers[0]
    if sampler is not None:
        positions = [(s.get("epoch"), s.get("consumed", s.get("yielded"))) for s in samplers]
        if len(set(positions)) > 1:
            raise StateMismatchError(
                f"the ranks' samplers are at different positions (epoch, samples consumed): "
                f"{positions}; every rank must draw the same number of "
                "batches before saving (a DataLoader with workers prefetches: pass consumed= to state_dict())"
            )
    return (rngs if rngs[0] is not None else None), sampler


def restore_rank_rng(states: Any, *, step: int | None, device: torch.device | None, source: str) -> bool:
    """Restore this rank's RNG streams from a checkpoint's per-rank list; return whether anything was restored.

    Local. Policy when the world size changed: ranks that exist in the checkpoint restore their own
    streams; new ranks seed theirs with ``derive_seed(saved seed, rank, step)``; rank 0 logs the
    change at WARNING, including saved streams that no rank restores.
    """
    if states is None:
        log_rank0(logging.INFO, "%s holds no RNG state; the RNG streams are left as they are", source)
        return False
    if not isinstance(states, (list, tuple)) or not states:
        raise StateMismatchError(f"{source}: the RNG entry is a {type(states).__name__}, not a list of per-rank states")
    rank, world = _rank_world()
    if rank < len(states):
        load_rng_state_dict(states[rank], device)
    else:
        derived = seed_rng(int(states[0]["seed"]), rank=rank, step=step or 0, device=device)
        logger.debug("rank %d: no saved RNG state; seeded with %d", rank, derived)
    if len(states) != world:
        new = f"ranks {len(states)}..{world - 1} derive new streams from the saved seed {states[0]['seed']}, " \
              f"their rank and step {step}" if world > len(states) else \
              f"the saved streams of ranks {world}..{len(states) - 1} are not used"
        log_rank0(logging.WARNING, "%s holds RNG state for %d rank(s) but the job has %d: ranks 0..%d restore "
                  "their own streams, %s; the run continues but does not reproduce the original one exactly",
                  source, len(states), world, min(world, len(states)) - 1, new)
    return True


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
            raise ValueError(f"drop_last=True with {self.num_samples} samples and {self.num_replicas} ranks "
                             "leaves every rank empty; use drop_last=False or fewer ranks")


class ResumableDistributedSampler(Sampler[int]):
    """A ``DistributedSampler`` that can be checkpointed mid-epoch and resumed at any world size.

    Local (no collectives). For a fresh epoch it yields exactly what ``DistributedSampler`` yields
    (same seeded permutation, rank ``r`` takes every ``num_replicas``-th index from ``r``).
    ``state_dict()`` holds the epoch and the samples consumed **globally** in it; after
    ``load_state_dict`` the rest of that epoch's permutation is split over the ranks present now,
    so with the same world size the run continues exactly, and with another one the epoch still
    ends with every sample seen once.

    Padding: only the final round of an epoch (fewer than ``num_replicas`` samples left) is
    padded with the permutation's first samples (``drop_last=False``) or dropped
    (``drop_last=True``), as in ``DistributedSampler``; a resume adds no padding of its own.

    Epochs advance by themselves: when an iteration reaches the end of the epoch the sampler moves
    to the next one, so forgetting ``set_epoch`` cannot repeat a shuffle. ``set_epoch(e)`` for the
    current epoch is a no-op (it keeps a resumed position); another ``e`` starts that epoch afresh.

    The position counts what the sampler has yielded, exact for a ``DataLoader`` with
    ``num_workers=0``; with workers that prefetch, pass ``consumed=`` to :meth:`state_dict`.

    Example::

        >>> s = dist_resume.ResumableDistributedSampler(range(10), num_replicas=2, rank=0, seed=1)
        >>> it = iter(s); first = [next(it), next(it)]; state = s.state_dict(); state["consumed"]
        4
        >>> t = dist_resume.ResumableDistributedSampler(range(10), num_replicas=1, rank=0, seed=1)
        >>> t.load_state_dict(state); len(list(t)), t.epoch   # the 6 samples the 2 ranks had left
        (6, 1)
    """

    def __init__(self, dataset: Sized | int, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            cur_rank, cur_world = _rank_world()
            num_replicas = cur_world if num_replicas is None else num_replicas
            rank = cur_rank if rank is None else rank
        n = dataset if isinstance(dataset, int) and not isinstance(dataset, bool) else len(dataset)  # type: ignore[arg-type]
        self._cfg = _SamplerConfig(n, num_replicas, rank, shuffle, seed, drop_last)
        self._epoch = 0
        self._start = 0  # global position where the current pass began
        self._yielded = 0  # indices this rank yielded since then
        self._pass = 0  # bumped by every new pass, set_epoch and load_state_dict: older iterators stop

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
        """Indices this rank yields from the current position to the end of the epoch."""
        return self._share(self.consumed)

    def __iter__(self) -> Iterator[int]:
        self._pass += 1
        token, start, w = self._pass, self.consumed, self._cfg.num_replicas
        self._start, self._yielded = start, 0
        order = self._order(self._epoch)
        rest = order[start:]
        total = self._share(start) * w
        if total > len(rest):  # pad the final round from the start of the permutation
            rest += (order * math.ceil((total - len(rest)) / len(order)))[: total - len(rest)]
        for index in rest[self._cfg.rank:total:w]:
            if self._pass != token:
                return  # superseded by a newer pass, set_epoch or load_state_dict
            self._yielded += 1
            yield index
        if self._pass == token:
            self._epoch, self._start, self._yielded = self._epoch + 1, 0, 0

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` afresh; a no-op when it is the current epoch (a resumed position is kept). Local."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch == self._epoch:
            return
        if 0 < self.consumed < self._cfg.num_samples:
            logger.warning("set_epoch(%d) abandons epoch %d after %d of %d samples", epoch, self._epoch,
                           self.consumed, self._cfg.num_samples)
        self._pass += 1
        self._epoch, self._start, self._yielded = epoch, 0, 0

    def state_dict(self, *, consumed: int | None = None) -> dict[str, Any]:
        """Epoch and global position, plus what must match on load. Local; plain ints and bools.

        ``consumed`` overrides the position with the samples *this rank* has trained on in the
        current pass (use it when DataLoader workers prefetch ahead of the training loop).
        """
        position = self.consumed
        if consumed is not None:
            if isinstance(consumed, bool) or not isinstance(consumed, int) or not 0 <= consumed <= self._yielded:
                raise ValueError(f"consumed={consumed!r} must be an int in 0..{self._yielded} (indices yielded)")
            position = min(self._start + consumed * self._cfg.num_replicas, self._cfg.num_samples)
        return {"epoch": self._epoch, "consumed": position, "num_samples": self._cfg.num_samples,
                "shuffle": self._cfg.shuffle, "seed": self._cfg.seed, "drop_last": self._cfg.drop_last,
                "world_size": self._cfg.num_replicas}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue from ``state_dict``'s epoch and position, at this sampler's world size. Local.

        Raises :class:`StateMismatchError` (changing nothing) when the dataset length, seed or
        shuffle differ, since the saved position would then point into another permutation.
        """
        check_sampler_state(self, state_dict)
        saved_world = int(state_dict.get("world_size", self._cfg.num_replicas))
        if saved_world != self._cfg.num_replicas:
            log_rank0(logging.INFO, "sampler: epoch %d resumes at sample %d of %d with %d rank(s) instead of %d; "
                      "the rest of the epoch is split over the new ranks", state_dict["epoch"],
                      state_dict["consumed"], self._cfg.num_samples, self._cfg.num_replicas, saved_world)
        self._pass += 1
        self._epoch, self._start, self._yielded = int(state_dict["epoch"]), int(state_dict["consumed"]), 0


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
    found = {"num_samples": state["num_samples"], "seed": state.get("seed", cfg.seed),
             "shuffle": state.get("shuffle", cfg.shuffle)}
    wrong = [f"{k} {v!r} saved, {getattr(cfg, k)!r} now" for k, v in found.items() if v != getattr(cfg, k)]
    if wrong:
        raise StateMismatchError(
            f"{source}: the saved sampler position belongs to another permutation ({'; '.join(wrong)}); "
            "resume with the same dataset, seed and shuffle, or start the epoch afresh without the sampler"
        )
    if state["consumed"] > cfg.num_samples:
        raise StateMismatchError(f"{source}: sampler consumed={state['consumed']} exceeds the dataset length "
                                 f"{cfg.num_samples}")
