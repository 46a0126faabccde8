"""Restoring into an FSDP2 model (``fully_shard``, DTensor parameters): read, validate on every rank, fill the shards.

The same plan as for a plain or DDP model (:func:`~dist_resume._checkpoint.plan.plan_restore`: names and shapes
against the full parameters, prefixes adapted, optimizer ids mapped to names), then what differs: the saved tensors
are full (or stand-ins of full tensors) and each rank keeps only its boxes. How the data reaches the shards
(:class:`Fill`) follows from the source, decided once:

- ``COPY``: a file every rank reads itself (memory-mapped on the CPU): each rank copies its boxes out of its mapping
  (:func:`~dist_resume._state.sharded.copy_full_into`); the rest of the file is never read;
- ``SCATTER``: ``broadcast_from_rank0``: rank 0 reads, the structure and small tensors (at most
  :data:`SMALL_BYTES` each: RNG states, scheduler, scaler) travel by broadcast, every other tensor stays on rank 0
  (the others plan on meta stand-ins) and rank 0 sends each rank its boxes
  (:func:`~dist_resume._dist.shard_comm.scatter_full_into`), received straight into the shards;
- ``DCP``: a sharded checkpoint folder (``ckpt_<step>.dcp/``) or any DCP folder: every rank reads its structure
  (meta stand-ins) and ``dcp.load`` fills the shards (:func:`~dist_resume._foreign.sharded_load.load_into_shards`),
  resharding from any world size.

All or nothing across ranks: reading and validation run on every rank, then every rank learns every outcome
(:func:`~dist_resume._dist.broadcast.agree_across_ranks`) and raises the lowest failing rank's typed error before
anything changes. Collective: call on every rank.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist

from .._core.errors import StateMismatchError, UsageError
from .._core.log import log_rank0
from .._core.tree import map_tensors
from .._dist.broadcast import agree_across_ranks, broadcast_loaded
from .._dist.shard_comm import scatter_full_into
from .._foreign.sharded_load import load_into_shards, read_dcp_skeleton, read_sharded_skeleton
from .._layout.layout import Layout
from .._source.integrity import verify_source
from .._source.read import SourceContents, parts_from_fields, parts_to_fields, read_source
from .._source.source import Source
from .._state.optim import optimizer_to
from .._state.sharded import check_optimizer_follows, copy_full_into, is_sharded, model_destinations, sharded_parameters
from .._state.sharded_optim import sharded_optimizer_state
from .apply import apply_then_fill
from .objects import LiveObjects
from .options import ResumeOptions
from .plan import RestorePlan

__all__ = ["Fill", "SMALL_BYTES", "ShardedRestore", "is_sharded_restore", "restore_sharded", "apply_sharded"]

_AGREED: Final = "could not restore the checkpoint into the FSDP2 model, so nothing was restored on any rank"
SMALL_BYTES: Final = 64 * 1024  # under broadcast_from_rank0, tensors up to this size reach every rank whole

Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class Fill(enum.Enum):
    """How the saved data reaches the shards."""

    COPY = "every rank copies its boxes out of its own mapping of the file"
    SCATTER = "rank 0 reads and sends each rank its boxes"
    DCP = "dcp.load reads each rank's boxes from the sharded folder"


@dataclass(frozen=True)
class ShardedRestore:
    """A validated plan for an FSDP2 model: what to copy where, in the same order on every rank."""

    plan: RestorePlan
    fill: Fill
    pairs: Pairs  # (saved tensor or stand-in, destination): model, EMA, then optimizer state
    optimizer_state: dict[str, Any] | None  # to load once filled: its state tensors are the destinations
    folder: Path | None = None  # DCP: the sharded folder
    dcp_keys: dict[int, str] = field(default_factory=dict)  # DCP: id(stand-in) -> the folder's key
    weights_only: bool = True


def is_sharded_restore(objects: LiveObjects) -> bool:
    """Whether ``objects.model`` is FSDP2-sharded (then :func:`restore_sharded` restores it). Local.

    An EMA sharded with ``fully_shard`` restores only next to a sharded model (both fill their shards here); next to
    a plain or DDP model it raises :class:`UsageError` (the same on every rank) instead of torch's raw error.
    """
    if is_sharded(objects.model):
        return True
    if objects.ema is not None and is_sharded(objects.ema):
        raise UsageError(
            "the EMA model is sharded with fully_shard but the model is not: a sharded EMA resumes only next to an "
            "FSDP2 model; pass an unsharded EMA (torch.optim.swa_utils.AveragedModel of a plain copy) or shard the "
            "model too"
        )
    return False


def _read_local(source: Source, options: ResumeOptions) -> tuple[SourceContents, Fill, dict[int, str]]:
    if source.layout is Layout.SHARDED:
        if options.verify:
            verify_source(source.path)
        parts, keys = read_sharded_skeleton(source.path, weights_only=options.weights_only)
        return SourceContents(source, parts=parts, collective=True), Fill.DCP, keys
    if source.layout is Layout.DCP:
        if options.verify:
            verify_source(source.path)
        parts, keys = read_dcp_skeleton(source.path, weights_only=options.weights_only)
        return SourceContents(source, parts=parts, collective=True), Fill.DCP, keys
    where = "cpu" if options.map_location is None else options.map_location
    read = read_source(
        source, map_location=where, mmap=options.mmap, weights_only=options.weights_only, verify=options.verify
    )
    return dataclasses.replace(read, collective=True), Fill.COPY, {}


@dataclass(frozen=True)
class _Held:
    """Stands in for a tensor that stays on rank 0 under ``broadcast_from_rank0``."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _read_broadcast(source: Source, options: ResumeOptions) -> SourceContents:
    """Rank 0 reads; every rank gets the structure and the small tensors, the large ones as meta stand-ins
    (rank 0 keeps its own). Collective; a failure on rank 0 raises on every rank."""
    rank0 = dist.get_rank() == 0
    held: list[torch.Tensor] = []
    view: Any = None
    failure: Exception | None = None
    if rank0:
        try:
            read = read_source(
                source, map_location="cpu", mmap=options.mmap, weights_only=options.weights_only, verify=options.verify
            )
            view = (read.obj, None if read.parts is None else parts_to_fields(read.parts))
        except Exception as err:  # every rank raises it, from broadcast_loaded
            failure = err

    def hold(t: torch.Tensor) -> Any:
        if t.numel() * t.element_size() <= SMALL_BYTES:
            return t
        held.append(t)
        return _Held(len(held) - 1, tuple(t.shape), t.dtype)

    def load() -> Any:
        if failure is not None:
            raise failure
        return map_tensors(view, hold)

    arrived = broadcast_loaded(load)

    def back(stand: _Held) -> torch.Tensor:
        return held[stand.index] if rank0 else torch.empty(stand.shape, dtype=stand.dtype, device="meta")

    obj, fields = map_tensors(arrived, back, kind=_Held)
    parts = None if fields is None else parts_from_fields(fields)
    return SourceContents(source, obj=obj, parts=parts, mmapped=rank0 and options.mmap, collective=True)


def prepare_sharded(
    plan: RestorePlan,
    fill: Fill,
    *,
    folder: Path | None = None,
    dcp_keys: dict[int, str] | None = None,
    weights_only: bool = True,
) -> ShardedRestore:
    """Check what only an FSDP2 model can refuse and list every copy; changes nothing. Local.

    Placements other than ``Shard``/``Replicate`` and an optimizer built before ``fully_shard`` raise; so does
    optimizer state that cannot be sharded like its parameter. A fresh optimizer's state destinations are
    allocated here (this rank's boxes only), so that the fill has somewhere to write.
    """
    live = plan.objects
    sharded_parameters(live.model)  # placements this restore supports, or StateMismatchError
    pairs: Pairs = [(full, dst) for _, full, dst in model_destinations(live.model, plan.model_state)]
    if live.ema is not None and plan.ema_state is not None:
        pairs += [(full, dst) for _, full, dst in model_destinations(live.ema, plan.ema_state)]
    optimizer_state = None
    if live.optimizer is not None and plan.optimizer_state is not None:
        check_optimizer_follows(live.model, live.optimizer)
        optimizer_state, opt_pairs = sharded_optimizer_state(live.optimizer, plan.optimizer_state, source=plan.source)
        pairs += opt_pairs
    keys = dcp_keys or {}
    if fill is Fill.DCP:
        unknown = [tuple(saved.shape) for saved, _ in pairs if id(saved) not in keys]
        if unknown:
            raise StateMismatchError(
                f"{plan.source}: {len(unknown)} tensor(s) to restore (shapes {unknown[:3]}) are not in the sharded "
                "folder's DCP files; the folder was changed or written by another tool: convert it to one file "
                "(dist-resume convert) and resume from that"
            )
    return ShardedRestore(plan, fill, pairs, optimizer_state, folder, keys, weights_only)


def restore_sharded(
    source: Source,
    objects: LiveObjects,
    options: ResumeOptions,
    plan_local: Callable[[SourceContents], RestorePlan],
) -> tuple[SourceContents, RestorePlan, tuple[str, ...]]:
    """Read ``source``, plan the restore (``plan_local``: split and :func:`plan_restore`, local), check it for the
    FSDP2 model on every rank, agree, then fill the shards. Collective; returns what was read, the plan and the
    names of the parts restored."""
    keys: dict[int, str] = {}
    if source.broadcast:  # a failure reading on rank 0 raises on every rank, from the broadcast
        contents, fill = _read_broadcast(source, options), Fill.SCATTER
    try:
        if not source.broadcast:
            contents, fill, keys = _read_local(source, options)
        plan = plan_local(contents)
        prepared = prepare_sharded(plan, fill, folder=source.path, dcp_keys=keys, weights_only=options.weights_only)
    except Exception as err:
        agree_across_ranks(err, what=_AGREED)
        raise
    agree_across_ranks(None, what=_AGREED)
    return contents, plan, apply_sharded(prepared)


def _fill(prepared: ShardedRestore) -> None:
    if prepared.fill is Fill.SCATTER:
        scatter_full_into(prepared.pairs)
    elif prepared.fill is Fill.DCP:
        assert prepared.folder is not None
        targets = {prepared.dcp_keys[id(saved)]: dst for saved, dst in prepared.pairs}
        load_into_shards(prepared.folder, targets, weights_only=prepared.weights_only)
    else:
        for full, dst in prepared.pairs:
            copy_full_into(dst, full)


def _extra_states(module: torch.nn.Module, state: Any) -> None:
    """Non-tensor ``_extra_state`` entries to their module's ``set_extra_state`` (as ``load_state_dict`` does)."""
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) and key.rpartition(".")[2] == "_extra_state":
            module.get_submodule(key.rpartition(".")[0]).set_extra_state(value)


def apply_sharded(prepared: ShardedRestore) -> tuple[str, ...]:
    """Change the live objects as :meth:`RestorePlan.apply` does, the model, EMA and optimizer through their shards.

    Collective for ``SCATTER`` and ``DCP`` (every rank fills in the same order), local for ``COPY``. The small states
    first, as apply's steps (GradScaler, scheduler, data position, RNG: a failure puts them back and raises
    :class:`~dist_resume.errors.RestoreError`); then every shard filled in place, the optimizer's state dict (its
    destinations) loaded and placed on its parameters' devices. No copy of the shards is kept (the memory bound): a
    failure while filling (data found damaged only as it is read, an I/O error) puts the small states back and
    raises, and the model and optimizer may then hold part of the checkpoint, as the error says.
    """
    plan = prepared.plan
    live = plan.objects

    def fill() -> None:
        _fill(prepared)
        _extra_states(live.model, plan.model_state)
        if live.ema is not None and plan.ema_state is not None:
            _extra_states(live.ema, plan.ema_state)
        if live.optimizer is not None and prepared.optimizer_state is not None:
            live.optimizer.load_state_dict(prepared.optimizer_state)
            optimizer_to(live.optimizer)

    restored = apply_then_fill(plan, fill)
    log_rank0(
        logging.DEBUG, "%s: FSDP2 shards filled (%s, %d tensors)", plan.source, prepared.fill.name, len(prepared.pairs)
    )
    return restored
