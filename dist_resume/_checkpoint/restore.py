"""resume(): read a checkpoint from one of three sources, plan the restore (validate everything), apply it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final

import torch
from torch import nn

from .._core.log import log_rank0
from .._core.types import MapLocation, PathLike
from .._dist.broadcast import agree_across_ranks
from .._dist.env import is_distributed
from .._layout.kinds import CONVENTIONAL
from .._layout.layout import FORMAT_NAME, CheckpointParts, Key, Layout, split_checkpoint
from .._source.read import Loaded, read_broadcast, read_file, read_folder
from .._state.prefix import model_key_map
from .options import OptimizerHparams, allowed_missing
from .plan import RestorePlan, plan_restore

__all__ = ["ResumeResult", "resume"]


@dataclass(frozen=True)
class ResumeResult:
    """What :func:`resume` found and restored.

    ``step`` is the number of optimizer steps completed when the checkpoint was saved, so a resumed loop
    continues at ``step`` (``for step in range(result.step, total)``); ``epoch`` is what was saved.
    ``restored`` names each part of which something was applied; ``skipped`` each part that was passed
    but not restored (absent from the file and allowed to be, or with nothing in it that applied).
    ``applied`` says how much of each part was applied, as ``(applied, total)``: ``applied["model"]`` the
    model keys loaded of ``len(model.state_dict())``, ``applied["optimizer"]`` the parameters whose state
    was restored of the optimizer's parameters, ``applied["ema"]`` the EMA keys loaded of its total; a part
    not passed, or absent from the file, has no entry. ``extra`` holds the file's other entries (e.g. ``args``).
    ``part_keys`` names the key each part came from in a torch file (``{"model": "MODEL_STATE", "epoch":
    "EPOCHS_RUN"}``; ``"state.net"`` one level down): what ``part_keys=`` would pass to choose the same.
    """

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
    applied: dict[str, tuple[int, int]] = field(default_factory=dict)
    part_keys: dict[str, str] = field(default_factory=dict)


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
    allow_missing: str | Iterable[str] = (),
    optimizer_hparams: OptimizerHparams | str = "checkpoint",
    ema: nn.Module | None = None,
    key_prefix: str | None = None,
    part_keys: Mapping[str, str] | None = None,
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
    Reads this toolkit's files, a bare state dict, any dict whose parts are recognised by name or
    content (``{"MODEL_STATE", "EPOCHS_RUN"}`` of PyTorch's DDP tutorial, Lightning ``.ckpt``,
    ``{"net", "opt", "it"}``; two candidates for a part it restores are an error naming them, and
    ``part_keys`` chooses), HF Trainer / Accelerate / DCP folders and ``.safetensors`` files (see
    docs/sources.md), with any ``module.``/``_orig_mod.`` prefixes, into a plain or wrapped model
    on any device.

    By default the file is memory-mapped on the CPU and copied into the existing tensors, so no
    rank holds a second full copy on its accelerator (``map_location`` overrides). Keys, shapes, dtypes,
    optimizer groups, parameter names and state shapes are validated before anything changes; on
    any error model, optimizer, scheduler, scaler and EMA are as before. Afterwards optimizer state
    sits on its parameters' devices.

    Options (all validated before anything changes):

    - ``strict`` keeps torch's meaning for the model: missing/unexpected keys raise, dtypes must match
      (``strict=False`` loads the keys that fit and casts floating-point tensors; if *no* key fits it
      still raises :class:`KeyMismatchError`). For compatibility ``strict=False`` also skips parts the
      file lacks, with a WARNING; ``allow_missing`` is the precise way.
    - ``allow_missing``: names of parts that may be absent from the file (``"optimizer"``,
      ``"scheduler"``, ``"scaler"``, ``"sampler"``, ``"rng"``, ``"ema"``, or ``"all"``). Each absent allowed
      part is left as it is and listed in ``ResumeResult.skipped``; a part passed but absent and not
      allowed raises :class:`StateMismatchError`; ``rng=True`` counts as passing the RNG part.
    - ``optimizer_hparams``: ``"checkpoint"`` (torch's rule, the default) takes each group's ``lr``,
      ``betas``, ``weight_decay``, ... from the file; ``"current"`` restores the per-parameter state
      but keeps the live optimizer's group hyperparameters (``initial_lr`` too). Either way each value
      that differs is logged at INFO; with ``"current"`` a restored scheduler that will set ``lr`` at
      its next step is logged at WARNING.
    - ``ema``: an EMA model (``torch.optim.swa_utils.AveragedModel``, ``n_averaged`` included, or any
      ``nn.Module``) restored from the file's EMA entry, its key prefixes adapted like the model's.
    - ``key_prefix``: load only the model keys under this prefix, without it (``"model."`` for a
      Lightning checkpoint of ``self.model``); the other keys are ignored, optimizer ``param_names``
      lose the prefix where they carry it. When a model does not fit and one would, the error names it.
    - ``part_keys``: ``{"model": "MODEL_STATE", ...}`` names the entry each part comes from,
      overriding layout detection.
    - ``args`` (an ``argparse.Namespace``, as torchvision references and timm save) loads under
      ``weights_only=True`` and comes back in ``ResumeResult.extra``.

    When the file holds sampler state but no ``sampler`` is passed, the epoch restarts from its first
    batch, logged at WARNING.

    Exact resume: ``sampler`` (a :class:`ResumableDistributedSampler`) continues at the saved epoch
    and position, split over the ranks present now; ``rng=True`` makes each rank restore its own
    saved RNG streams (python, torch CPU, its accelerator device, numpy). When the world size changed,
    ranks missing from the checkpoint derive theirs from the saved seed, their rank and the step,
    and rank 0 logs it at WARNING. A file without RNG state raises unless
    ``allow_missing`` names ``"rng"`` (then the streams are left as they are). Both are validated before anything changes and listed in ``restored``.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> path = dist_resume.save_checkpoint("ckpt.pt", model=model, optimizer=opt, step=7)
        >>> dist_resume.resume(path, model=model, optimizer=opt).step
        7
    """
    allowed = allowed_missing(allow_missing)  # usage errors before any file is read
    hparams = OptimizerHparams.parse(optimizer_hparams)
    build = partial(
        plan_restore,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        rng=rng,
        strict=strict,
        allow_missing=allowed,
        optimizer_hparams=hparams,
        ema=ema,
        key_prefix=key_prefix,
    )
    given = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "ema": ema, "sampler": sampler}
    wanted = {"model", *(part for part, obj in given.items() if obj is not None), *(("rng",) if rng else ())}
    split = partial(_split, model=model, key_prefix=key_prefix, part_keys=part_keys, wanted=wanted)
    if broadcast_from_rank0 and is_distributed():
        if map_location is not None:
            raise ValueError(
                "map_location cannot be combined with broadcast_from_rank0=True: the state arrives "
                "on the CPU and is copied into the model's and optimizer's own tensors"
            )
        loaded, plan = read_broadcast(
            path, mmap=mmap, weights_only=weights_only, verify=verify, prepare=lambda view: _plan(view, split, build)
        )
    else:
        read = read_folder if Path(path).is_dir() else read_file
        loaded = read(path, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
        plan = _plan(loaded, split, build)
    restored = plan.apply()
    parts = plan.parts
    log_rank0(
        logging.INFO,
        "resumed from %s (%s layout%s, step %s, epoch %s; restored %s)",
        loaded.path,
        parts.layout.value,
        _key_sources(parts),
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
        dict(plan.applied),
        dict(parts.keys),
    )


def _split(
    obj: Any, source: str, *, model: nn.Module, key_prefix: str | None, part_keys: Any, wanted: set[str]
) -> CheckpointParts:
    """``split_checkpoint`` with what layout detection can use: the entries named by ``part_keys``, the
    model's canonical keys (under ``key_prefix``) to pick the entry that fits, and the parts to restore."""
    model_keys = [(key_prefix or "") + k for k in model_key_map(model)]
    return split_checkpoint(obj, source, model_keys=model_keys, part_keys=part_keys, wanted=wanted)


_COUNTERS: Final = {"step": ("global_step",)}  # Lightning's and HF Trainer's name for it
_FOREIGN: Final = (Layout.HF_TRAINER, Layout.ACCELERATE, Layout.DCP, Layout.SAFETENSORS)  # parts named by files


def _key_sources(parts: CheckpointParts) -> str:
    """``"; model <- 'MODEL_STATE', ..."`` when some part of a torch file came from a key not named for it.

    A known layout under its own names (``model``, ``optimizer``, ``epoch``) says nothing; one part
    under another name (``{"model", "opt", "Epoch"}``) and every detected layout name them all.
    """
    if parts.layout in _FOREIGN or not parts.keys:
        return ""
    named = all(
        key in (part, *CONVENTIONAL.get(part, ()), *_COUNTERS.get(part, ())) for part, key in parts.keys.items()
    )
    return "" if named and parts.layout is not Layout.DETECTED else f"; {parts.describe_keys()}"


def _plan(loaded: Loaded, split: Callable[..., CheckpointParts], build: Callable[..., RestorePlan]) -> RestorePlan:
    """Validate ``loaded`` against the live objects; where it is collective, every rank learns every outcome
    and raises if any rank failed, before anything changes."""
    source = f"checkpoint {str(loaded.path)!r}"
    try:
        parts = loaded.parts if loaded.parts is not None else split(loaded.obj, source)
        plan = build(parts, ema_entry=_toolkit_ema(loaded.obj), source=source, mmapped=loaded.mmapped)
    except Exception as err:
        if loaded.collective:
            agree_across_ranks(err)
        raise
    if loaded.collective:
        agree_across_ranks(None)
    return plan


def _toolkit_ema(obj: Any) -> Any:
    """The EMA entry of a dist_resume file (used where ``CheckpointParts`` carries no ``ema`` yet)."""
    if isinstance(obj, Mapping) and obj.get(Key.FORMAT) == FORMAT_NAME:
        return obj.get(Key.EMA)
    return None
