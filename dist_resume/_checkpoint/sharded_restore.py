"""Restoring into an FSDP2 model (``fully_shard``, DTensor parameters): read, validate on every rank, fill the shards.

The same plan as for a plain or DDP model (:func:`~dist_resume._checkpoint.plan.restore_plan.plan_restore`: names and shapes
against the full parameters, prefixes adapted, optimizer ids mapped to names), then what differs: the saved tensors
are full (or stand-ins of full tensors) and each rank keeps only its boxes. How the data reaches the shards
(:class:`Fill`) follows from the source, decided once:

- ``COPY``: a file every rank reads itself (memory-mapped on the CPU): each rank copies its boxes out of its mapping
  (:func:`~dist_resume._state.sharded.copy_full_into`); the rest of the file is never read;
- ``SCATTER``: ``broadcast_from_rank0``: rank 0 reads, the structure and small tensors (at most
  :data:`SMALL_BYTES` each: RNG states, scheduler, scaler) travel by broadcast, every other tensor stays on rank 0
  (the others plan on meta stand-ins) and rank 0 sends each rank its boxes
  (:func:`~dist_resume._dist.shard_comm.scatter_full_into`), received straight into the shards;
- ``OWN``: an FSDP2 snapshot in shared memory (:mod:`~dist_resume._foreign.own_shards`): each rank reads its own file
  of its own shards (meta stand-ins for the plan) and copies each into its destination, whose box must be the saved
  one (the same world size, mesh and placements);
- ``DCP``: a sharded checkpoint folder (``ckpt_<step>.dcp/``) or any DCP folder: every rank reads its structure
  (meta stand-ins) and ``dcp.load`` fills the shards (:func:`~dist_resume._foreign.sharded_load.load_into_shards`),
  resharding from any world size.

All or nothing across ranks: reading and validation run on every rank, then every rank learns every outcome
(:func:`~dist_resume._dist.broadcast.agree_across_ranks`) and raises the lowest failing rank's typed error before
anything changes. Collective: call on every rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch
import torch.distributed as dist

from .._core.errors import StateMismatchError, UsageError
from .._core.location import Location
from .._core.tree import map_tensors
from .._dist.agree import agree_across_ranks
from .._dist.broadcast import broadcast_loaded
from .._foreign.own_shards import Box, check_boxes, read_own_shards
from .._foreign.sharded_load import read_dcp_skeleton, read_sharded_skeleton
from .._layout.layout import Layout
from .._source.integrity import verify_source
from .._source.read import SourceContents, parts_from_fields, parts_to_fields, read_source
from .._source.source import Source, SourceKind
from .._state.optim.sharded import sharded_optimizer_state
from .._state.sharded import check_optimizer_follows, is_sharded, model_destinations, sharded_parameters
from .apply.module_step import refuse_load_hooks
from .apply.step import Pairs
from .apply.transaction import Agree
from .objects import LiveObjects
from .options import ResumeOptions
from .plan.restore_plan import RestorePlan
from .sharded_apply import Fill, ShardedRestore, apply_sharded

__all__ = ["SMALL_BYTES", "is_sharded_restore", "prepare_sharded", "restore_sharded"]

_AGREED: Final = "could not restore the checkpoint into the FSDP2 model, so nothing was restored on any rank"
SMALL_BYTES: Final = 64 * 1024  # under broadcast_from_rank0, tensors up to this size reach every rank whole


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


@dataclass(frozen=True)
class _Own:
    """What an FSDP2 snapshot's file gave this rank: each saved local tensor and its box, by key."""

    saved: dict[str, torch.Tensor]
    boxes: dict[str, Box | None]


def _read_local(source: Source, options: ResumeOptions) -> tuple[SourceContents, Fill, dict[int, str], _Own | None]:
    if source.kind is SourceKind.OWN_SHARDS:
        parts, keys, saved, boxes = read_own_shards(
            source.path, rank=dist.get_rank(), world_size=dist.get_world_size(), weights_only=options.weights_only
        )
        return SourceContents(source, parts=parts, mmapped=True, collective=True), Fill.OWN, keys, _Own(saved, boxes)
    if source.layout is Layout.SHARDED:
        # every CRC-32 before anything changes: each rank all of them under verify=True; else rank 0 checked them all
        # when it chose a folder's newest checkpoint, or the ranks split the check (each a share of the files)
        chosen = source.kind is SourceKind.FOLDER_NEWEST
        share = (0, 1) if options.verify else None if chosen else (dist.get_rank(), dist.get_world_size())
        parts, keys = read_sharded_skeleton(source.path, weights_only=options.weights_only, share=share)
        return SourceContents(source, parts=parts, collective=True), Fill.DCP, keys, None
    if source.layout is Layout.DCP:
        if options.verify:
            verify_source(source.path)
        parts, keys = read_dcp_skeleton(source.path, weights_only=options.weights_only)
        return SourceContents(source, parts=parts, collective=True), Fill.DCP, keys, None
    where = "cpu" if options.map_location is None else options.map_location
    read = read_source(
        source, map_location=where, mmap=options.mmap, weights_only=options.weights_only, verify=options.verify
    )
    return dataclasses.replace(read, collective=True), Fill.COPY, {}, None


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
    folder: Location | None = None,
    dcp_keys: dict[int, str] | None = None,
    weights_only: bool = True,
    own: _Own | None = None,
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
    optimizer_state, opt_pairs = None, list[tuple[torch.Tensor, torch.Tensor]]()
    if live.optimizer is not None and plan.optimizer_state is not None:
        check_optimizer_follows(live.model, live.optimizer)
        optimizer_state, opt_pairs = sharded_optimizer_state(live.optimizer, plan.optimizer_state, source=plan.source)
        pairs += opt_pairs
    refuse_load_hooks(live.model, plan.source)
    if live.ema is not None:
        refuse_load_hooks(live.ema, plan.source)
    keys = dcp_keys or {}
    if fill in (Fill.DCP, Fill.OWN):
        unknown = [tuple(saved.shape) for saved, _ in pairs if id(saved) not in keys]
        if unknown:
            raise StateMismatchError(
                f"{plan.source}: {len(unknown)} tensor(s) to restore (shapes {unknown[:3]}) are not in the sharded "
                "folder's DCP files; the folder was changed or written by another tool: convert it to one file "
                "(dist-resume convert) and resume from that"
            )
    saved: dict[str, torch.Tensor] = {}
    if own is not None:  # every destination is the saved tensor's box, checked before anything changes
        check_boxes({keys[id(s)]: dst for s, dst in pairs}, own.boxes, plan.source)
        saved = own.saved
    dests = tuple(dst for _, dst in opt_pairs)
    return ShardedRestore(plan, fill, pairs, optimizer_state, dests, folder, keys, weights_only=weights_only, own=saved)


def restore_sharded(
    source: Source,
    objects: LiveObjects,
    options: ResumeOptions,
    plan_local: Callable[[SourceContents], RestorePlan],
    agree: Agree,
) -> tuple[SourceContents, RestorePlan, tuple[str, ...]]:
    """Read ``source``, plan the restore (``plan_local``: split and :func:`plan_restore`, local), check it for the
    FSDP2 model on every rank, agree, then apply (``agree``: apply's agreements, see :func:`apply_sharded`).
    Collective; returns what was read, the plan and the names of the parts restored."""
    keys: dict[int, str] = {}
    own: _Own | None = None
    if source.broadcast:  # a failure reading on rank 0 raises on every rank, from the broadcast
        contents, fill = _read_broadcast(source, options), Fill.SCATTER
    try:
        if not source.broadcast:
            contents, fill, keys, own = _read_local(source, options)
        plan = plan_local(contents)
        prepared = prepare_sharded(
            plan, fill, folder=source.path, dcp_keys=keys, weights_only=options.weights_only, own=own
        )
    except Exception as err:
        agree_across_ranks(err, what=_AGREED)
        raise
    agree_across_ranks(None, what=_AGREED)
    return contents, plan, apply_sharded(prepared, agree=agree)
