"""Random draws made while loading data are made again after a resume: one stream per sample, one per batch.

A DataLoader worker draws from its process's global streams (torch's CPU generator, Python's ``random``, NumPy's),
seeded once when the worker starts: by the time of a checkpoint they have moved on in a process no checkpoint can see,
so a resumed run's workers draw other numbers for the same samples (FACTS 46). dist_resume seeds those streams
itself instead, for each sample from ``(sampler seed, epoch, index)`` before the dataset's ``__getitem__`` runs, and
for each batch from its samples' seeds before the ``collate_fn`` runs (mixup, cutmix): every draw made while loading
a sample is a pure function of what the sample is, the same in a resumed run as in an uninterrupted one, whichever
worker loads it, with any number of workers, ``prefetch_factor`` or ``persistent_workers``. (With ``num_workers=0``
the main process loads from the training streams, which a checkpoint holds: nothing to seed there.)

How the seeds travel: :class:`~dist_resume.ResumableDistributedSampler` yields each index tagged with its sample's
seed (:class:`SampleIndex`, an ``int`` to everyone else), the batches of those indices reach the workers as they are,
and a registered loader's workers (:mod:`.loader_hooks`) give their dataset copy a ``__getitems__`` that seeds before
loading each tagged index (the fetcher asks for it when batching, torch >= 2.2). ``sample_streams=False`` on the
sampler opts out: the workers' draws are then torch's, from streams no checkpoint holds.
"""

from __future__ import annotations

import hashlib
import random
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Subset, get_worker_info

__all__ = ["SampleIndex", "seeded_items", "WorkerStreams", "stream_seed"]


class SampleIndex(int):
    """A dataset index that carries the seed of its sample's stream (an ``int`` to the dataset)."""

    seed: int

    def __new__(cls, index: int, seed: int) -> SampleIndex:
        tagged = super().__new__(cls, index)
        tagged.seed = seed
        return tagged

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:  # to a worker, through its index queue
        return SampleIndex, (int(self), self.seed)


def stream_seed(*key: int | str) -> int:
    """A 63-bit seed, a pure function of ``key`` (the sampler's seed, the epoch, the index; or a batch's seeds)."""
    digest = hashlib.sha256(":".join(("dist_resume:stream", *map(str, key))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _seed_streams(seed: int) -> None:
    random.seed(seed)
    torch.default_generator.manual_seed(seed)
    numpy = sys.modules.get("numpy")  # seeded when the script uses it; never imported here
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


def _batched(dataset: Any) -> Callable[[Any, Any], Any] | None:
    """The class's own ``__getitems__`` (one call per batch), or None: load sample by sample (torch's ``Subset``
    passes a batch down sample by sample unless its dataset batches)."""
    own = getattr(type(dataset), "__getitems__", None)
    if own is None or (own is Subset.__getitems__ and _batched(dataset.dataset) is None):
        return None
    return own  # type: ignore[no-any-return]


def seeded_items(dataset: Any, indices: Sequence[Any]) -> list[Any]:
    """The samples at ``indices``, each loaded right after its stream was seeded (a dataset that loads a batch at once,
    ``__getitems__`` of its own, gets the batch's seed); then the streams are seeded for the batch's ``collate_fn``."""
    own = _batched(dataset)
    seeds: list[int] = [seed for index in indices if isinstance(seed := getattr(index, "seed", None), int)]
    if len(seeds) != len(indices):  # untagged: a sampler dist_resume cannot key, loaded as torch loads them
        return list(own(dataset, indices)) if own is not None else [dataset[index] for index in indices]
    batch_seed = stream_seed("batch", *seeds)
    if own is not None:
        _seed_streams(batch_seed)
        data = list(own(dataset, [int(index) for index in indices]))
    else:
        data = []
        for index, seed in zip(indices, seeds, strict=True):
            _seed_streams(seed)
            data.append(dataset[index])
    _seed_streams(stream_seed("collate", batch_seed))
    return data


class WorkerStreams:
    """A tracked loader's ``worker_init_fn``: the user's own, then the worker's dataset copy loads batches through
    :func:`seeded_items`. Picklable (workers started with spawn or forkserver receive it)."""

    def __init__(self, user_init: Callable[[int], Any] | None) -> None:
        self.user_init = user_init

    def __call__(self, worker_id: int) -> None:
        if self.user_init is not None:
            self.user_init(worker_id)
        info = get_worker_info()
        dataset = None if info is None else info.dataset
        try:  # an instance attribute: the fetcher looks it up on the object, so this copy alone batches through it
            dataset.__getitems__ = lambda indices: seeded_items(dataset, indices)  # type: ignore[union-attr]
        except (AttributeError, TypeError):  # a dataset that takes no attributes: loaded unseeded, as torch does
            pass
