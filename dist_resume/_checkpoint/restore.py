"""resume(): read a checkpoint, validate every part against the live objects, then apply all of it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.errors import KeyMismatchError, OptimizerStateMismatchError, StateMismatchError
from .._core.log import log_rank0
from .._core.tree import iter_tensors
from .._core.types import MapLocation, PathLike
from .._dist.broadcast import agree_across_ranks
from .._dist.env import is_distributed
from .._exact.sampler import check_sampler_state, param_device, restore_rank_rng
from .._format.layout import CheckpointParts, Layout, split_checkpoint
from .._format.load import load_checkpoint
from .._state.optim import optimizer_to, prepare_optimizer_state
from .._state.prefix import adapt_state_dict, match_keys, model_key_map
from .._state.validate import check_dtypes, check_scaler, check_scheduler
from .consensus import resolve_checkpoint
from .sources import load_broadcast

__all__ = ["ResumeResult", "resume", "restore_parts"]


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


def _storage_ptrs(obj: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in iter_tensors(obj) if t.device.type == "cpu"}


def _detach_from_file(optimizer: torch.optim.Optimizer, loaded: set[int]) -> None:
    """Clone state tensors that still alias the memory-mapped checkpoint (CPU params, same dtype)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.untyped_storage().data_ptr() in loaded
            ):
                state[key] = value.clone()


def _live_twins(
    optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]
) -> Iterator[tuple[Any, str, torch.Tensor, torch.Tensor]]:
    """``(saved id, key, saved tensor, live tensor)`` for each saved state tensor whose live counterpart (same
    parameter and key) already exists with the same shape and dtype. ``opt_sd`` comes from prepare_optimizer_state."""
    saved_ids = [i for group in opt_sd["param_groups"] for i in group["params"]]
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    for sid, param in zip(saved_ids, live_params):
        live_state = optimizer.state.get(param, {})
        for key, value in (opt_sd["state"].get(sid) or {}).items():
            dst = live_state.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(dst, torch.Tensor)
                and dst.shape == value.shape
                and dst.dtype == value.dtype
            ):
                yield sid, key, value, dst


def _into_live_state(optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]) -> dict[str, Any]:
    """``opt_sd`` with each saved state tensor that has a live twin copied into that twin and replaced by it:
    torch's load_state_dict then keeps it as it is."""
    state = {sid: dict(entries) for sid, entries in opt_sd["state"].items()}
    with torch.no_grad():
        for sid, key, value, dst in _live_twins(optimizer, opt_sd):
            dst.copy_(value)
            state[sid][key] = dst
    return {**opt_sd, "state": state}


def _fits(src: Any, dst: Any) -> bool:
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and dst.is_contiguous()
    )


def _live_destinations(
    parts: CheckpointParts, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> dict[int, torch.Tensor]:
    """``{id(saved tensor): live tensor}`` for model entries and existing optimizer state that data can land in."""
    out: dict[int, torch.Tensor] = {}
    live = model.state_dict(keep_vars=True)
    for saved, target in match_keys(parts.model.keys(), model_key_map(model)).items():
        if _fits(parts.model[saved], live.get(target)):
            out[id(parts.model[saved])] = live[target].detach()
    if optimizer is not None and parts.optimizer is not None:
        opt_sd = prepare_optimizer_state(parts.optimizer, optimizer, model)
        for _, _, value, dst in _live_twins(optimizer, opt_sd):
            if dst.is_contiguous():
                out[id(value)] = dst
    return out


def restore_parts(
    parts: CheckpointParts,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    strict: bool = True,
    source: str = "checkpoint",
    agree: Callable[[BaseException | None], None] | None = None,
    detach: bool = True,
    apply: bool = True,
) -> tuple[tuple[str, ...], tuple[str, ...], list[str], list[str]]:
    """Validate every part against the live objects, then apply them all (see :func:`resume`).

    ``agree`` is called between the two phases with this rank's validation error (or None); under
    broadcast loading it makes every rank raise if any rank failed, so no rank applies alone.
    """
    skipped: list[str] = []

    def absent(what: str) -> None:
        if strict:
            raise StateMismatchError(
                f"{source} ({parts.layout.value} layout) has no {what} state but a {what} was passed; "
                f"pass strict=False to restore what the file has, or do not pass the {what}"
            )
        skipped.append(what)

    # 1. validate everything, change nothing
    try:
        try:
            adapted = adapt_state_dict(parts.model, model, strict=strict)
        except KeyMismatchError as err:  # say which file
            raise KeyMismatchError(
                f"{source}: {err}", missing=err.missing, unexpected=err.unexpected, mismatched=err.mismatched
            ) from err
        check_dtypes(adapted, model, strict, source)
        live_keys = model.state_dict().keys()
        missing = [k for k in live_keys if k not in adapted]
        # saved keys are in the checkpoint's form, adapted ones in the model's: compare through the pairing
        paired = match_keys(parts.model.keys(), model_key_map(model)) if len(adapted) < len(parts.model) else {}
        unexpected = [k for k in parts.model if k not in paired] if len(adapted) < len(parts.model) else []
        opt_sd = None
        if optimizer is not None:
            saved_class = parts.meta.get("optimizer_class")
            if parts.optimizer is None:
                absent("optimizer")
            elif saved_class and saved_class != type(optimizer).__name__:
                raise OptimizerStateMismatchError(
                    f"{source}: the optimizer state was saved from {saved_class}, this optimizer is "
                    f"{type(optimizer).__name__}; build a {saved_class}, or pass strict=False and no optimizer"
                )
            else:
                opt_sd = prepare_optimizer_state(parts.optimizer, optimizer, model, source=source)
        if scheduler is not None:
            if parts.scheduler is None:
                absent("scheduler")
            else:
                check_scheduler(parts.scheduler, scheduler, source)
        if scaler is not None:
            if parts.scaler is None:
                absent("scaler")
            elif not parts.scaler and not strict:
                skipped.append("scaler")
            else:
                check_scaler(parts.scaler, scaler, source)

    except Exception as err:
        if agree is not None:
            agree(err)  # collective: every rank learns who failed
        raise
    if agree is not None:
        agree(None)  # raises here if another rank failed, before anything changes
    if not apply:
        return (), tuple(skipped), missing, unexpected

    # 2. apply. Everything that can still fail goes first; the optimizer goes last, copied into its live
    # state tensors where they exist, so no rollback copy of its state is ever held
    before_sched = scheduler.state_dict() if scheduler is not None and "scheduler" not in skipped else None
    before_scaler = scaler.state_dict() if scaler is not None and "scaler" not in skipped else None
    try:
        if before_scaler is not None:
            scaler.load_state_dict(parts.scaler)
        if before_sched is not None:
            scheduler.load_state_dict(parts.scheduler)
        model.load_state_dict(adapted, strict=strict)
    except Exception:
        if before_scaler is not None:
            scaler.load_state_dict(before_scaler)
        if before_sched is not None:
            scheduler.load_state_dict(before_sched)
        raise
    if opt_sd is not None and optimizer is not None:
        optimizer.load_state_dict(_into_live_state(optimizer, opt_sd))
        if detach:
            _detach_from_file(optimizer, _storage_ptrs(parts.optimizer))
        optimizer_to(optimizer)
    restored = [
        name
        for name, done in (
            ("scaler", before_scaler is not None),
            ("optimizer", opt_sd is not None and optimizer is not None),
            ("scheduler", before_sched is not None),
        )
        if done
    ]
    restored.insert(0, "model")
    return tuple(restored), tuple(skipped), missing, unexpected


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
    agree = None
    if broadcast_from_rank0 and is_distributed():
        if map_location is not None:
            raise ValueError(
                "map_location cannot be combined with broadcast_from_rank0=True: the state arrives "
                "on the CPU and is copied into the model's and optimizer's own tensors"
            )

        def prepare(chosen: Path, view: Any) -> dict[int, torch.Tensor]:
            """Validate on every rank before any data moves; receivers get their own tensors as destinations."""
            parts_view = split_checkpoint(view, f"checkpoint {str(chosen)!r}")
            restore_parts(
                parts_view,
                model=model,
                optimizer=optimizer,
                scheduler=scheduler,
                scaler=scaler,
                strict=strict,
                source=f"checkpoint {str(chosen)!r}",
                agree=agree_across_ranks,
                apply=False,
            )
            return {} if dist.get_rank() == 0 else _live_destinations(parts_view, model, optimizer)

        path, obj = load_broadcast(path, mmap=mmap, weights_only=weights_only, verify=verify, prepare=prepare)
        agree = agree_across_ranks
    else:
        path = resolve_checkpoint(path)
        obj = load_checkpoint(
            path,
            map_location="cpu" if map_location is None else map_location,
            mmap=mmap,
            weights_only=weights_only,
            verify=verify,
        )
    source = f"checkpoint {str(path)!r}"
    parts = split_checkpoint(obj, source)
    if sampler is not None and parts.sampler is None and strict:
        raise StateMismatchError(
            f"{source} ({parts.layout.value} layout) has no sampler state but a sampler was passed; "
            "pass strict=False to start the epoch afresh, or do not pass the sampler"
        )
    if sampler is not None and parts.sampler is not None:
        check_sampler_state(sampler, parts.sampler, source)  # validate before anything changes
    restored, skipped, missing, unexpected = restore_parts(
        parts,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        strict=strict,
        source=source,
        agree=agree,
        detach=mmap and (agree is None or dist.get_rank() == 0),
    )
    if sampler is not None:
        if parts.sampler is None:
            skipped += ("sampler",)
        else:
            sampler.load_state_dict(parts.sampler)
            restored += ("sampler",)
    if rng and restore_rank_rng(parts.rng, step=parts.step, device=param_device(model), source=source):
        restored += ("rng",)
    log_rank0(
        logging.INFO,
        "resumed from %s (%s layout, step %s, epoch %s; restored %s)",
        path,
        parts.layout.value,
        parts.step,
        parts.epoch,
        ", ".join(restored),
    )
    return ResumeResult(
        Path(path),
        parts.layout,
        parts.step,
        parts.epoch,
        parts.extra,
        dict(parts.meta),
        restored,
        skipped,
        missing,
        unexpected,
    )
