"""Random draws derived per sample, so that a resumed run draws them again: augmentation inside DataLoader workers."""

from __future__ import annotations

import torch
from torch.utils.data import get_worker_info

from .rng import derive_seed

__all__ = ["sample_seed"]


def sample_seed(index: int) -> int:
    """A seed for the random draws of dataset sample ``index``, for ``Dataset.__getitem__``. Local.

    A worker's own RNG stream cannot be saved: it lives in the worker process and has moved on by the time of a
    checkpoint, so a resumed run's workers draw other numbers (other noise for the same samples). Draws seeded
    from this function are made again: inside a DataLoader worker it is a pure function of ``index`` and the base
    seed of the worker's iterator (``get_worker_info().seed`` less the worker's id, the same in every worker of
    one iterator and new for each epoch's iterator), whichever worker loads the sample. torchdata's
    ``StatefulDataLoader`` restores that base seed on resume (any ``num_workers``, ``prefetch_factor``,
    ``persistent_workers``), so its samples get the same draws as in an uninterrupted run; torch's own
    ``DataLoader`` does not, so with its workers the resumed epoch's samples get other draws (later epochs the
    same, without ``persistent_workers``). In the main process (``num_workers=0``) the base is the number the torch
    CPU stream would give next, which a resume restores, read without drawing it: a batch loaded twice (the DDP
    tutorial's peek, again after a resume) leaves the stream as it was. With ``persistent_workers=True`` one iterator serves every epoch, so a
    sample gets the same draws each epoch.

    Example::

        >>> def noisy(x: torch.Tensor, index: int) -> torch.Tensor:  # in Dataset.__getitem__
        ...     g = torch.Generator().manual_seed(dist_resume.sample_seed(index))
        ...     return x + 0.1 * torch.randn(x.shape, generator=g)
        >>> _ = torch.manual_seed(0); a = noisy(torch.zeros(2), 7)
        >>> _ = torch.manual_seed(0); torch.equal(a, noisy(torch.zeros(2), 7))
        True
    """
    worker = get_worker_info()
    if worker is not None:
        base = int(worker.seed) - int(worker.id)
    else:  # the number the CPU stream would give next, the stream untouched: a batch loaded twice draws nothing
        stream = torch.Generator()
        stream.set_state(torch.get_rng_state())
        base = int(torch.empty((), dtype=torch.int64).random_(generator=stream).item())
    return derive_seed(base, rank=0, step=int(index))
