"""Sending a loaded checkpoint from global rank 0 to every rank through torch.distributed, in bounded buckets."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError, DistResumeError, StateMismatchError
from .._core.tree import map_tensors
from .comm import (
    RESTART_HINT,
    Outcome,
    all_gather_objects,
    collective_step,
    comm_device,
    relabel,
    released_by_backend,
    run_on_rank0,
)

__all__ = ["DEFAULT_BUCKET_BYTES", "broadcast_loaded", "agree_across_ranks", "first_failure"]

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class _Slot:
    """Stands in for a tensor in the structure sent ahead of the data."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """The structure of ``obj`` with every tensor replaced by a :class:`_Slot` (tensors appended to ``tensors``)."""

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(t)
        return _Slot(len(tensors) - 1, tuple(t.shape), t.dtype)

    return map_tensors(obj, slot)


def _join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return map_tensors(skeleton, lambda slot: tensors[slot.index], kind=_Slot)


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's data."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _send_tensors(
    tensors: list[torch.Tensor], slots: list[_Slot] | None, bucket_bytes: int, dests: dict[int, torch.Tensor]
) -> list[torch.Tensor]:
    """Broadcast the data of ``tensors`` (rank 0), bucket by bucket, into ``dests[slot index]`` where given
    (e.g. the model's own parameters) and into fresh CPU tensors otherwise (other ranks)."""
    rank0 = dist.get_rank() == 0
    device = comm_device()
    if rank0:
        out = [t.detach().cpu().contiguous() for t in tensors]
    else:
        assert slots is not None
        out = [dests[s.index] if s.index in dests else torch.empty(s.shape, dtype=s.dtype) for s in slots]
    flat = [_bytes_of(t) for t in out]
    bucket = torch.empty(
        min(bucket_bytes, max((f.numel() for f in flat), default=0)) or 1, dtype=torch.uint8, device=device
    )
    total = -(-sum(f.numel() for f in flat) // bucket.numel())  # every bucket but the last is full
    # receivers may be writing into the model's own tensors: a broken stream leaves them half-loaded
    partly = "this rank's model and optimizer may hold part of the checkpoint; " if dests else ""
    hint = f"{RESTART_HINT} and resume again ({partly}the checkpoint file itself is untouched)"
    pending: list[tuple[torch.Tensor, int, int]] = []  # (flat tensor, start, length) packed into the bucket
    used = 0
    sent = 0

    def flush() -> None:
        nonlocal used, sent
        if not pending:
            return
        if rank0:
            offset = 0
            for src, start, length in pending:
                bucket[offset : offset + length].copy_(src[start : start + length])
                offset += length
        sent += 1
        verb = "sending" if rank0 else "receiving"
        chunk = bucket[:used]
        with collective_step(f"{verb} the broadcast checkpoint (bucket {sent} of {total})", CheckpointError, hint):
            with released_by_backend(chunk):
                dist.broadcast(chunk, src=0)
        if not rank0:
            offset = 0
            for dst, start, length in pending:
                dst[start : start + length].copy_(bucket[offset : offset + length])
                offset += length
        pending.clear()
        used = 0

    for f in flat:
        start = 0
        while start < f.numel():
            length = min(f.numel() - start, bucket.numel() - used)
            pending.append((f, start, length))
            used += length
            start += length
            if used == bucket.numel():
                flush()
    flush()
    return out


def broadcast_loaded(
    load: Callable[[], Any],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    prepare: Callable[[Any], dict[int, torch.Tensor]] | None = None,
) -> Any:
    """Run ``load`` on global rank 0 and give every rank the same object, tensors as CPU tensors.

    Collective: call it on every rank. The structure travels first (one object broadcast), then the
    tensor data in buckets of at most ``bucket_bytes``. If ``load`` raises on rank 0, every rank
    raises the same dist_resume error class. ``prepare`` runs on every rank between the two, on rank
    0's object (rank 0) or on a stand-in whose tensors are on the meta device (the others): it may
    validate (collectively) and returns ``{id(stand-in tensor): destination}`` so that data lands
    directly in existing tensors of the same shape and dtype.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    rank0 = dist.get_rank() == 0
    tensors: list[torch.Tensor] = []  # filled on rank 0 while the structure is split off
    skeleton = run_on_rank0(
        lambda: _split(load(), tensors), fallback=CheckpointError, task="read the checkpoint and send its structure"
    )
    slots = None if rank0 else _collect_slots(skeleton)
    dests: dict[int, torch.Tensor] = {}
    if prepare is not None:
        if rank0:
            prepare(_join(skeleton, tensors))
        else:
            assert slots is not None
            stand_ins = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in slots]
            by_id = {id(t): i for i, t in enumerate(stand_ins)}
            dests = {by_id[key]: dst for key, dst in prepare(_join(skeleton, stand_ins)).items() if key in by_id}
    data = _send_tensors(tensors, slots, bucket_bytes, dests)
    return _join(skeleton, data)


def _collect_slots(skeleton: Any) -> list[_Slot]:
    found: list[_Slot] = []
    map_tensors(skeleton, found.append, kind=_Slot)
    return sorted(found, key=lambda slot: slot.index)


def agree_across_ranks(
    error: BaseException | None,
    *,
    what: str = "could not restore the broadcast checkpoint, so nothing was restored on any rank",
) -> None:
    """Collective: share each rank's validation outcome; raise on every rank if any rank failed.

    A rank passing its own ``error`` returns (its caller raises that). Every other rank raises the
    lowest failing rank's error: the same class with its attributes (``missing``, ``hint``, ...) and
    ``rank`` set, its message naming every rank that failed and ``what`` (``StateMismatchError`` chained to
    the original for an exception that is no dist_resume error).
    """
    rank = dist.get_rank()
    mine = Outcome() if error is None else Outcome.failed(rank, error)
    try:
        with collective_step(f"agreeing that every rank can restore {what}", CheckpointError):
            outcomes: list[Outcome] = all_gather_objects(mine)
    except DistResumeError:
        if error is not None:
            return  # this rank's own failure says more; its caller raises it
        raise
    err = first_failure(outcomes, StateMismatchError, what)
    if err is not None and error is None:
        raise err


def first_failure(outcomes: list[Outcome], fallback: type[DistResumeError], what: str) -> DistResumeError | None:
    """The error every rank raises when some of ``outcomes`` (one per rank) failed, else None. Local.

    The lowest failing rank's error (its class and attributes, ``rank`` set; ``fallback`` for one that is no
    dist_resume error), its message naming every failing rank: ``rank(s) [1, 3] <what>; rank 1: <its message>``.
    """
    failed = [o.error for o in outcomes if o.error is not None]
    if not failed:
        return None
    first = failed[0]
    err = first.rebuild(fallback)
    message = first.message if type(err).__qualname__ == first.class_name else str(err)
    return relabel(err, f"rank(s) {[f.rank for f in failed]} {what}; rank {first.rank}: {message}")
