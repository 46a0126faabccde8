"""The save calls: :func:`save_checkpoint` and :func:`save_checkpoint_async`. Each names the live objects once, refuses
a state no reader could resume (:mod:`.saveable`), checks the ranks in, gathers the payload's collective part and makes
the user's path a ``Location``; then the write, now (:func:`~.save.write_checkpoint`) or in the background
(:func:`~.async_save.write_in_background`)."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .._checkpoint.moved import refuses_moved_keywords
from .._checkpoint.objects import LiveObjects
from .._core.location import Location
from .._core.types import PathLike
from .._dist.checkin import check_in
from .._exact.data import stateful_data
from .._store.url import location
from .async_save import AsyncSave, wait_pending, write_in_background
from .save import prepare_payload, write_checkpoint
from .saveable import check_saveable

__all__ = ["save_checkpoint", "save_checkpoint_async"]


@refuses_moved_keywords
def save_checkpoint(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    dataloader: Any = None,
    ema: nn.Module | None = None,
    step: int | None = None,
    epoch: int | None = None,
    extra: Any = None,
    rng: bool = True,
    full_state: bool = False,
) -> Location:
    """Save model, optimizer, scheduler and GradScaler state, with metadata, atomically.

    Collective under torch.distributed: call it on every rank, not inside ``if rank == 0:`` (a call on some ranks
    only is named within seconds, see :class:`CheckpointManager`); every rank returns once the file is in place
    (or raises the same error). A DDP model saved to a local folder every rank sees is written by every rank, each
    its share of the tensor records, into the one file (a striped save; the file is an ordinary ``torch.save``
    file); otherwise global rank 0 writes it. Local in a single process.
    Model keys are stored in canonical form (no ``module.``/``_orig_mod.``) and optimizer groups
    carry canonical ``param_names``, so the file resumes into plain, DDP or compiled models alike.
    The file loads under ``torch.load(weights_only=True)``.

    For exact resume, ``rng=True`` (the default, as on :func:`resume`) stores every rank's RNG streams
    (python, torch CPU, the rank's own accelerator device, numpy), gathered on rank 0; ``dataloader`` (a
    ``DataLoader`` whose sampler is a :class:`ResumableDistributedSampler`, torchdata's
    ``StatefulDataLoader``, that sampler itself, or its state dict, ``sampler.state_dict(consumed=...)``)
    stores the epoch and the position in it of what the loop trained on, after checking that all ranks
    agree on it (docs/exact-resume.md says what each loader reproduces). ``step`` is the number of
    optimizer steps completed (a resumed loop continues at ``ResumeResult.step``); without ``epoch``, the
    epoch saved is the one the loop continues in, from the data position.

    ``ema`` (a ``torch.optim.swa_utils.AveragedModel``, ``n_averaged`` included, or any ``nn.Module``
    holding averaged weights) is stored under ``"ema"`` with canonical keys, like the model;
    ``resume(..., ema=...)`` restores it.

    A model sharded with FSDP2 (``fully_shard``) is saved by every rank in parallel into a sharded
    checkpoint **folder** at ``path`` (a DCP folder, plus ``train_state.pt`` and ``manifest.json``; committed
    by one rename once every rank's files are durable: see docs/checkpoint-folders.md), which ``dcp.load``
    and ``dist-resume convert`` read. ``full_state=True`` writes one ordinary torch file instead, gathered
    tensor by tensor on rank 0, which loads into a plain or DDP model like any other; for a model that is
    not sharded, ``full_state`` changes nothing (one file either way).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> dist_resume.save_checkpoint("ckpt.pt", model=model, optimizer=opt, step=100)
        PosixPath('ckpt.pt')
    """
    started = time.perf_counter()
    objects = LiveObjects(model, optimizer, scheduler, scaler, stateful_data(dataloader, saving=True), ema)
    check_saveable(objects, step=step, epoch=epoch, extra=extra, where="save_checkpoint")
    check_in(f"dist_resume.save_checkpoint(step={step!r})")  # a call made on some ranks only is named, not hung
    build, epoch = prepare_payload(objects, step=step, epoch=epoch, extra=extra, rng=rng)
    where = location(path)  # the entry: decided here, passed down as it is
    return write_checkpoint(where, build, step=step, epoch=epoch, model=model, full_state=full_state, started=started)


@refuses_moved_keywords
def save_checkpoint_async(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    dataloader: Any = None,
    ema: nn.Module | None = None,
    step: int | None = None,
    epoch: int | None = None,
    extra: Any = None,
    rng: bool = True,
    full_state: bool = False,
) -> AsyncSave:
    """Like :func:`save_checkpoint`, but return once the state is snapshotted; write in a background thread.

    Collective under torch.distributed: call it on every rank (a call on some ranks only is named within seconds,
    see :class:`CheckpointManager`). It first waits for the previous
    asynchronous save (so its errors surface here at the latest), then rank 0 copies the state to
    CPU memory (pinned memory for accelerator tensors where the backend supports it, waiting for the
    copies with ``torch.accelerator.synchronize``) and a thread writes it atomically. Training may
    change the model and optimizer right away. ``wait()`` on the handle blocks until the file is
    durable. The snapshot's CPU buffers stay allocated and are reused by the next asynchronous save (no
    1 GiB allocation per save for a 1 GiB state), so rank 0 keeps one extra copy of the state in CPU
    memory.

    A DDP model saved to a local folder every rank sees is striped: every rank copies only its own share of the
    tensor records (rank 0: its share, the small ones and the pickle's structure) and writes it into the one file from
    a thread of its own; the CRCs are gathered and rank 0 commits the file there, on a second gloo process group
    (made once). An FSDP2 model's sharded checkpoint folder is written by every rank in a thread of its own from a CPU
    copy of its shards (the collectives of the write run on a second gloo process group, made once), so
    training goes on meanwhile; with ``full_state=True`` the file is gathered and written before this returns
    (the gather is a collective stream), and the handle is done at once.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> handle = dist_resume.save_checkpoint_async("ckpt.pt", model=model, step=1)
        >>> handle.wait()
        PosixPath('ckpt.pt')
    """
    objects = LiveObjects(model, optimizer, scheduler, scaler, stateful_data(dataloader, saving=True), ema)
    check_saveable(objects, step=step, epoch=epoch, extra=extra, where="save_checkpoint_async")
    check_in(f"dist_resume.save_checkpoint_async(step={step!r})")  # a call on some ranks only is named, not hung
    wait_pending()
    started = time.perf_counter()
    build, epoch = prepare_payload(objects, step=step, epoch=epoch, extra=extra, rng=rng)
    where = location(path)  # the entry: decided here, passed down as it is
    return write_in_background(
        where, build, step=step, epoch=epoch, model=model, full_state=full_state, started=started
    )
