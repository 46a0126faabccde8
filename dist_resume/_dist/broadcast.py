"""Sending a loaded checkpoint from global rank 0 to every rank through torch.distributed, in bounded buckets.

The structure travels first (:func:`receive_structure`: one object broadcast, meta stand-ins for the tensors on the
other ranks); the data moves later, tensor by tensor as each rank chooses (:meth:`Incoming.send`), straight into its
destinations: a resume can validate on the stand-ins, change what may fail, agree across ranks, and only then
receive the data into its live tensors, holding one bucket (at most ``bucket_bytes``) beyond them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError
from .._core.tree import map_tensors
from .agree import agree_across_ranks
from .comm import RESTART_HINT, collective_step, comm_device, released_by_backend, run_on_rank0

__all__ = ["DEFAULT_BUCKET_BYTES", "LazyData", "Incoming", "receive_structure", "broadcast_loaded"]

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


def _collect_slots(skeleton: Any) -> list[_Slot]:
    found: list[_Slot] = []
    map_tensors(skeleton, found.append, kind=_Slot)
    return sorted(found, key=lambda slot: slot.index)


class LazyData(Protocol):
    """Where rank 0's stand-ins keep their data (a checkpoint on an object store, read by ranges)."""

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a stand-in whose data this reads."""

    def read_fresh(self, tensors: Sequence[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{id(stand-in): a new CPU tensor with its data}``."""

    def read_bytes(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Bytes ``[start, start + len(out))`` of the stand-in's data (contiguous, as saved) into the uint8 ``out``."""


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's data."""
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


class Incoming:
    """A loaded object sent by global rank 0: its structure is on every rank, its tensors' data moves on demand.

    ``obj`` is rank 0's object on rank 0 and, on the other ranks, the same structure whose tensors are meta
    stand-ins (shape and dtype, no data). Tensors are numbered by slot, the same on every rank. ``lazy`` (rank 0):
    where rank 0's own stand-ins keep their data; it is read as it is sent, one bucket at a time.
    """

    def __init__(self, obj: Any, tensors: list[torch.Tensor], bucket_bytes: int, lazy: LazyData | None = None) -> None:
        self.obj = obj
        self._tensors = tensors  # by slot: rank 0's real tensors, the others' stand-ins
        self._slot = {id(t): i for i, t in enumerate(tensors)}
        self.bucket_bytes = bucket_bytes
        self._lazy = lazy

    @property
    def slots(self) -> int:
        """How many tensors ``obj`` holds."""
        return len(self._tensors)

    def slot(self, tensor: torch.Tensor) -> int | None:
        """The slot of a tensor of ``obj`` (None for any other tensor)."""
        return self._slot.get(id(tensor))

    def tensor(self, slot: int) -> torch.Tensor:
        """The tensor of ``obj`` in ``slot``: rank 0's data, or a stand-in."""
        return self._tensors[slot]

    def send(
        self,
        slots: Sequence[int],
        dests: Mapping[int, torch.Tensor] | None = None,
        *,
        what: str = "the checkpoint",
        into_live: bool = False,
    ) -> tuple[dict[int, torch.Tensor], Exception | None]:
        """Move the data of ``slots`` (the same on every rank) from rank 0 to every rank. Collective.

        Each slot's data lands in ``dests[slot]`` where this rank gives one (a tensor of its shape; copied with a
        cast where the dtype differs), otherwise in a fresh CPU tensor (rank 0 keeps its own tensor); returns
        ``{slot: the tensor holding its data}``. A failure on this rank while packing, unpacking or copying does not
        stop it taking part: it runs every remaining bucket and returns the first such failure, so that no rank is
        left waiting (the caller's agreement then tells every rank). A lost peer raises :class:`CheckpointError`,
        saying that this rank's live tensors may hold part of the checkpoint where ``into_live`` (``dests`` are them).
        """
        dests = dests or {}
        rank0 = dist.get_rank() == 0
        order = sorted(set(slots))
        out: dict[int, torch.Tensor] = {}
        wires: list[torch.Tensor] = []
        sources: list[torch.Tensor | None] = []  # rank 0: the stand-in a wire's bytes are read from, else None
        after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (destination, what arrived): copied once all arrived
        failure: Exception | None = None
        lazy = self._lazy if rank0 else None
        fresh: dict[int, torch.Tensor] = {}
        if lazy is not None:  # rank 0's own data for slots without a destination: read now, then sent as usual
            try:
                own = [self._tensors[i] for i in order if i not in dests and lazy.holds(self._tensors[i])]
                fresh = lazy.read_fresh(own)
            except Exception as err:  # still sent (as zeros): the agreement after says why
                failure = err
        for i in order:
            t, dst = self._tensors[i], dests.get(i)
            if lazy is not None and lazy.holds(t):
                t = fresh.get(id(t), torch.zeros(t.shape, dtype=t.dtype)) if dst is None else t
            if lazy is not None and t.is_meta:  # read from the store as it is sent, received here like elsewhere
                assert dst is not None  # a stand-in without a destination was read fresh above
                wire = dst if dst.shape == t.shape and dst.dtype == t.dtype and _direct(dst) else None
                if wire is None:
                    wire = torch.empty(t.shape, dtype=t.dtype)
                    after.append((dst, wire))
                wires.append(wire)
                sources.append(t)
                out[i] = dst
                continue
            sources.append(None)
            if rank0:
                try:
                    wires.append(t.detach().cpu().contiguous())
                except Exception as err:  # still sent (as zeros): the agreement after says why
                    failure = failure or err
                    wires.append(torch.zeros(t.shape, dtype=t.dtype))
                if dst is not None:
                    after.append((dst, t))
                out[i] = t if dst is None else dst
            elif dst is not None and dst.shape == t.shape and dst.dtype == t.dtype and _direct(dst):
                wires.append(dst)
                out[i] = dst
            else:
                wire = torch.empty(t.shape, dtype=t.dtype)
                wires.append(wire)
                if dst is not None:
                    after.append((dst, wire))
                out[i] = wire if dst is None else dst
        failure = _send_tensors(wires, self.bucket_bytes, what, failure, into_live=into_live, lazy=(lazy, sources))
        if failure is None:
            try:
                with torch.no_grad():
                    for dst, src in after:
                        dst.copy_(src)
            except Exception as err:  # reported by the caller's agreement, on every rank
                failure = err
        return out, failure


def _direct(dst: torch.Tensor) -> bool:
    """Whether the bucket's bytes can be copied straight into ``dst`` (contiguous; on any device: the bucket is
    where the backend receives, each slice of it is copied on)."""
    return dst.is_contiguous()


def _send_tensors(
    tensors: list[torch.Tensor],
    bucket_bytes: int,
    what: str,
    failure: Exception | None = None,
    *,
    into_live: bool = False,
    lazy: tuple[LazyData | None, list[torch.Tensor | None]] = (None, []),
) -> Exception | None:
    """Broadcast the bytes of ``tensors`` (rank 0's data; the others receive into theirs), bucket by bucket.

    Every rank runs every bucket's broadcast, even after a local failure (packing on rank 0, unpacking elsewhere),
    so that one rank's fault never leaves the others waiting; returns the first local failure (or ``failure``).
    ``lazy`` (rank 0): where the stand-ins' data is read, and for each tensor the stand-in its bytes come from (then
    rank 0 receives the bucket into that tensor, as the other ranks do), or None."""
    rank0 = dist.get_rank() == 0
    reader, sources = lazy
    device = comm_device()
    flat = [_bytes_of(t) for t in tensors]
    bucket = torch.empty(
        min(bucket_bytes, max((f.numel() for f in flat), default=0)) or 1, dtype=torch.uint8, device=device
    )
    total = -(-sum(f.numel() for f in flat) // bucket.numel())  # every bucket but the last is full
    partly = "this rank's model and optimizer may hold part of the checkpoint; " if into_live else ""
    hint = f"{RESTART_HINT} and resume again ({partly}the checkpoint file itself is untouched)"
    pending: list[tuple[int, int, int]] = []  # (tensor index, start, length) packed into the bucket
    used = 0
    sent = 0

    def unpack_or_pack(into_bucket: bool) -> None:
        nonlocal failure
        if failure is not None:
            return
        try:
            offset = 0
            for i, start, length in pending:
                t, source = flat[i], sources[i] if sources else None
                if into_bucket and source is not None and reader is not None:
                    reader.read_bytes(source, start, bucket[offset : offset + length])
                elif into_bucket:
                    bucket[offset : offset + length].copy_(t[start : start + length])
                elif not rank0 or source is not None:
                    t[start : start + length].copy_(bucket[offset : offset + length])
                offset += length
        except Exception as err:  # every remaining bucket still moves; the caller's agreement says why
            failure = err

    def flush() -> None:
        nonlocal used, sent
        if not pending:
            return
        if rank0:
            unpack_or_pack(into_bucket=True)
        sent += 1
        verb = "sending" if rank0 else "receiving"
        chunk = bucket[:used]
        with collective_step(f"{verb} {what} (bucket {sent} of {total})", CheckpointError, hint):
            with released_by_backend(chunk):
                dist.broadcast(chunk, src=0)
        unpack_or_pack(into_bucket=False)
        pending.clear()
        used = 0

    for i, f in enumerate(flat):
        start = 0
        while start < f.numel():
            length = min(f.numel() - start, bucket.numel() - used)
            pending.append((i, start, length))
            used += length
            start += length
            if used == bucket.numel():
                flush()
    flush()
    return failure


def receive_structure(
    load: Callable[[], Any], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, lazy: LazyData | None = None
) -> Incoming:
    """Run ``load`` on global rank 0 and give every rank its structure; the data waits for :meth:`Incoming.send`.

    Collective: call it on every rank (one object broadcast). If ``load`` raises on rank 0, every rank raises the
    same dist_resume error class. On the other ranks the tensors of the structure are meta stand-ins; on rank 0 too
    where ``lazy`` holds them (their data is read from it as it is sent).
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    rank0 = dist.get_rank() == 0
    tensors: list[torch.Tensor] = []  # filled on rank 0 while the structure is split off
    skeleton = run_on_rank0(
        lambda: _split(load(), tensors), fallback=CheckpointError, task="read the checkpoint and send its structure"
    )
    if not rank0:
        tensors = [torch.empty(s.shape, dtype=s.dtype, device="meta") for s in _collect_slots(skeleton)]
    return Incoming(_join(skeleton, tensors), tensors, bucket_bytes, lazy if rank0 else None)


def broadcast_loaded(load: Callable[[], Any], *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Any:
    """Run ``load`` on global rank 0 and give every rank the same object, tensors as CPU tensors.

    Collective: call it on every rank. The structure travels first (one object broadcast), then the tensor data in
    buckets of at most ``bucket_bytes``. If ``load`` raises on rank 0, every rank raises the same dist_resume error
    class; a failure while one rank packs or unpacks the data raises :class:`CheckpointError` on every rank.
    """
    incoming = receive_structure(load, bucket_bytes=bucket_bytes)
    data, failure = incoming.send(range(incoming.slots))
    what = "could not receive the broadcast checkpoint"
    error = None if failure is None else CheckpointError(f"{what}: {type(failure).__name__}: {failure}")
    agree_across_ranks(error, what=what, fallback=CheckpointError)
    if error is not None:
        raise error from failure
    arrived = {id(incoming.tensor(i)): t for i, t in data.items()}
    return map_tensors(incoming.obj, lambda t: arrived.get(id(t), t))
