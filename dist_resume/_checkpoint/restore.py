"""resume(): read a checkpoint from one of three sources, plan the restore (validate everything), apply it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._core.log import log_rank0
from .._core.types import MapLocation, PathLike
from .._dist.broadcast import agree_across_ranks
from .._dist.env import is_distributed
from .._format.layout import Layout, split_checkpoint
from .plan import RestorePlan, plan_restore
from .sources import Loaded, read_broadcast, read_file, read_folder

__all__ = ["ResumeResult", "resume"]


@dataclass(frozen=True)
class ResumeResult:
    """What :func:`resume` found and restored."""

    path: Path
    layout: Layout
    step: int | None
    epoch: int | None
    extra: Any
    metadata: dict[str, Any]
    restored: tuple[str, ...]
    skipped: tuple[str, ...] = ()
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)


def resume(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    sampler: Any = None,
    rng: bool = False,
    verify: bool = False,
    broadcast_from_rank0: bool = False,
) -> ResumeResult:
    """Restore model, optimizer, LR scheduler and GradScaler from a checkpoint, all or nothing.

    Local for a file: each rank reads the file and restores its own objects (call it on every rank,
    after wrapping the model in DDP or before, either works). ``path`` may also be a checkpoint
    folder (:class:`CheckpointManager`): then it is collective under torch.distributed, rank 0
    picks the newest complete checkpoint and every rank confirms it sees the same file (see
    :func:`resolve_checkpoint`). ``verify=True`` checks the CRC-32 of every record before loading.
    ``broadcast_from_rank0=True`` (collective) lets only global rank 0 open the file; the state reaches
    the other ranks through torch.distributed broadcasts in bounded buckets (for node-local disks,
    and to spare the filesystem N identical reads), with the same validation on every rank and no
    rank applying anything unless all of them validated.
    Reads this toolkit's files and the common foreign layouts (a bare state dict,
    ``{"model", "optimizer"}``, ``{"state_dict"}``, ``{"model_state_dict", "optimizer_state_dict"}``),
    with any ``module.``/``_orig_mod.`` prefixes, into a plain or wrapped model on any device.

    By default the file is memory-mapped on the CPU and copied into the existing tensors, so no
    rank holds a second full copy on its GPU (``map_location`` overrides). Keys, shapes, dtypes,
    optimizer groups, parameter names and state shapes are validated before anything changes; on
    any error model, optimizer, scheduler and scaler are as before. Afterwards optimizer state
    sits on its parameters' devices. ``strict=False`` allows missing/unexpected model keys and
    parts the file lacks.

    Exact resume: ``sampler`` (a :class:`ResumableDistributedSampler`) continues at the saved epoch
    and position, split over the ranks present now; ``rng=True`` makes each rank restore its own
    saved RNG streams (python, torch CPU, its CUDA device, numpy). When the world size changed,
    ranks missing from the checkpoint derive theirs from the saved seed, their rank and the step,
    and rank 0 logs it at WARNING. A file without RNG state leaves the streams as they are
    (logged at INFO). Both are validated before anything changes and listed in ``restored``.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> dist_resume.save_checkpoint("ckpt.pt", model=model, optimizer=opt, step=7)
        >>> dist_resume.resume("ckpt.pt", model=model, optimizer=opt).step
        7
    """
    build = partial(
        plan_restore,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        rng=rng,
        strict=strict,
    )
    if broadcast_from_rank0 and is_distributed():
        if map_location is not None:
            raise ValueError(
                "map_location cannot be combined with broadcast_from_rank0=True: the state arrives "
                "on the CPU and is copied into the model's and optimizer's own tensors"
            )
        loaded, plan = read_broadcast(
            path, mmap=mmap, weights_only=weights_only, verify=verify, prepare=lambda view: _plan(view, build)
        )
    else:
        read = read_folder if Path(path).is_dir() else read_file
        loaded = read(path, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
        plan = _plan(loaded, build)
    restored = plan.apply()
    parts = plan.parts
    log_rank0(
        logging.INFO,
        "resumed from %s (%s layout, step %s, epoch %s; restored %s)",
        loaded.path,
        parts.layout.value,
        parts.step,
        parts.epoch,
        ", ".join(restored),
    )
    return ResumeResult(
        loaded.path,
        parts.layout,
        parts.step,
        parts.epoch,
        parts.extra,
        dict(parts.meta),
        restored,
        plan.skipped,
        list(plan.missing_keys),
        list(plan.unexpected_keys),
    )


def _plan(loaded: Loaded, build: Callable[..., RestorePlan]) -> RestorePlan:
    """Validate ``loaded`` against the live objects; where it is collective, every rank learns every outcome
    and raises if any rank failed, before anything changes."""
    source = f"checkpoint {str(loaded.path)!r}"
    try:
        parts = loaded.parts if loaded.parts is not None else split_checkpoint(loaded.obj, source)
        plan = build(parts, source=source, mmapped=loaded.mmapped)
    except Exception as err:
        if loaded.collective:
            agree_across_ranks(err)
        raise
    if loaded.collective:
        agree_across_ranks(None)
    return plan
