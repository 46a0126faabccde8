"""Rank 0's full tensors to every rank's FSDP2 shards (loading), and every rank's shards to rank 0 (saving).

Point to point, box by box: rank 0 knows every rank's box of a DTensor from its mesh and placements
(:func:`dist_resume._core.shards.rank_regions`), so nothing is negotiated. Loading, rank 0 sends each
rank only its box, straight from the full tensor (a view of a memory-mapped file: the pages are read
where they are, no copy), and each rank receives it straight into its shard: no rank allocates anything
when the destinations exist. Saving, only one rank per distinct box sends (HSDP's replicas hold the
same box), and rank 0 receives into one reusable buffer of at most ``bucket_bytes``: it never holds a
full tensor unless a box is not one contiguous run of it (a shard on a dimension other than the first).
``DTensor.full_tensor()`` would instead all-gather every full tensor onto every rank.

Collective: every rank calls the same function on the same list, in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError, CheckpointWriteError, StateMismatchError
from .._core.shards import ShardSpec, flat_range, is_dtensor, local_of, rank_regions, shard_spec
from .comm import collective_step, comm_device, released_by_backend

__all__ = ["Scratch", "scatter_full_into", "gather_full", "full_pieces", "send_own_shard"]

Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # (global rank, local shape, offset)


class Scratch:
    """One reusable byte buffer, grown to the largest request: what rank 0 receives boxes into."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` over the buffer (valid until the next take)."""
        nbytes = math.prod(shape) * dtype.itemsize
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(0, dtype=torch.uint8, device=self.device)  # let go before growing
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf[:nbytes].view(dtype).view(shape)

    @property
    def nbytes(self) -> int:
        return self._buf.numel()


def _sources(spec: ShardSpec) -> list[Box]:
    """One non-empty box per distinct region of the full tensor, each from the first rank (mesh order) holding it."""
    seen: set[tuple[tuple[int, ...], tuple[int, ...]]] = set()
    out = []
    for rank, shape, offset in rank_regions(spec):
        if math.prod(shape) and (shape, offset) not in seen:
            seen.add((shape, offset))
            out.append((rank, shape, offset))
    return out


def _box(shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` where this process group's collectives take it (a CPU tensor goes to the GPU for nccl)."""
    device = comm_device()
    return t if t.device == device else t.to(device)


def _chunks(flat: torch.Tensor, bucket_bytes: int) -> Iterator[torch.Tensor]:
    step = max(1, bucket_bytes // max(1, flat.element_size()))
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


def scatter_full_into(pairs: Sequence[tuple[torch.Tensor | None, torch.Tensor]]) -> None:
    """Fill each destination with its part of rank 0's full tensor, in place. Collective: call on every rank.

    ``pairs`` is ``[(full, destination), ...]`` in the same order on every rank; ``full`` is the full
    tensor on global rank 0 (e.g. memory-mapped) and ignored elsewhere (None, or a meta stand-in). A
    DTensor destination receives its box, a plain one (a buffer, an unsharded parameter) all of it.
    Rank 0 sends views of ``full``; receivers receive into their destinations (through one box-sized
    buffer where a destination is not contiguous, or lives where the backend does not send from).

    A failure on this rank while reading or copying a tensor does not stop it taking part: it sends (zeros) and
    receives every remaining box, then raises that failure, so that no rank is left waiting in a collective.
    """
    rank = dist.get_rank()
    failure: Exception | None = None
    for i, (full, dst) in enumerate(pairs):
        step = f"receiving the checkpoint's shards (tensor {i + 1} of {len(pairs)})"
        with collective_step(step, CheckpointError):
            if rank == 0:
                failure = _send_boxes(full, dst, failure)
            else:
                failure = _receive_box(dst, failure)
    if failure is not None:
        raise failure


def _send_boxes(full: torch.Tensor | None, dst: torch.Tensor, failure: Exception | None) -> Exception | None:
    """Rank 0's part for one pair; after a failure (``failure``, or one here), zeros of each box's shape are sent."""
    if is_dtensor(dst):
        spec = shard_spec(dst)
        boxes = [box for box in rank_regions(spec) if box[0] != 0 and 0 not in box[1]]  # non-empty, not mine
    else:
        boxes = [(r, tuple(dst.shape), (0,) * dst.dim()) for r in range(1, dist.get_world_size())]
    outgoing: list[tuple[int, torch.Tensor]] = []
    if failure is None:
        try:
            outgoing = _own_box_and_outgoing(full, dst, boxes)
        except Exception as err:  # the boxes still go out (zeros): the caller's agreement says why
            failure = err
    if failure is not None:
        outgoing = [(r, _wire(torch.zeros(s, dtype=dst.dtype))) for r, s, _ in boxes]
    with released_by_backend(*(t for _, t in outgoing)):
        _wait_all([dist.isend(t, dst=r) for r, t in outgoing])
    return failure


def _own_box_and_outgoing(
    full: torch.Tensor | None, dst: torch.Tensor, boxes: list[Box]
) -> list[tuple[int, torch.Tensor]]:
    if full is None:
        raise ValueError("scatter_full_into: rank 0 needs the full tensor of every pair")
    if is_dtensor(full):
        raise StateMismatchError("scatter_full_into: rank 0's full tensor is a DTensor; pass the checkpoint's tensors")
    if is_dtensor(dst):
        spec = shard_spec(dst)
        if tuple(full.shape) != spec.global_shape:
            raise StateMismatchError(f"cannot scatter a tensor of shape {tuple(full.shape)} as {spec.global_shape}")
        local = local_of(dst)
        if local.numel():
            with torch.no_grad():
                local.copy_(full[spec.slices()])
    else:
        with torch.no_grad():
            dst.copy_(full)
    return [(r, _wire(full[_box(s, o)].to(dst.dtype).contiguous())) for r, s, o in boxes]


def _wait_all(works: list[Any]) -> None:
    """Wait for each send; a finished Work still owns its tensor, so none may outlive this call."""
    while works:
        work = works.pop()
        if work is not None:  # None: this rank is not in the group
            work.wait()
        del work


def _receive_box(dst: torch.Tensor, failure: Exception | None) -> Exception | None:
    """A receiver's part for one pair; after a failure (``failure``, or one here), the box is received and dropped."""
    local = local_of(dst)  # a rank outside the DTensor's mesh holds an empty one
    if not local.numel():
        return failure
    direct = failure is None and local.is_contiguous() and local.device == comm_device()
    target = local if direct else torch.empty(local.shape, dtype=local.dtype, device=comm_device())
    with released_by_backend(target):
        dist.recv(target, src=0)
    if not direct and failure is None:
        try:
            with torch.no_grad():
                local.copy_(target)
        except Exception as err:  # every remaining box is still received; the caller's agreement says why
            return err
    return failure


def send_own_shard(tensor: torch.Tensor, *, bucket_bytes: int) -> None:
    """This rank's part of gathering ``tensor`` to rank 0 (:func:`gather_full`, :func:`full_pieces`). Collective
    in pairs with them: a rank other than 0 that is the first (mesh order) to hold a non-empty box sends it,
    in parts of at most ``bucket_bytes``; every other rank does nothing."""
    if not is_dtensor(tensor) or dist.get_rank() == 0:
        return
    me = dist.get_rank()
    spec = shard_spec(tensor)
    if not any(r == me for r, _, _ in _sources(spec)):
        return
    local = _wire(local_of(tensor).detach().contiguous()).reshape(-1)
    with collective_step("sending this rank's shards to rank 0 for the checkpoint", CheckpointWriteError):
        for part in _chunks(local, bucket_bytes):
            with released_by_backend(part):
                dist.send(part, dst=0)


def gather_full(tensor: torch.Tensor, out: torch.Tensor | None = None, *, bucket_bytes: int) -> torch.Tensor | None:
    """The full value of ``tensor`` on global rank 0 (in ``out`` when given), None on the other ranks.

    Collective: every rank calls it (others run :func:`send_own_shard` inside). A plain tensor is
    taken as is from rank 0. Rank 0 receives each box straight into ``out`` where the box is one
    contiguous run of it, else through a box-sized buffer; the other ranks allocate nothing.
    """
    if dist.get_rank() != 0:
        send_own_shard(tensor, bucket_bytes=bucket_bytes)
        return None
    if not is_dtensor(tensor):
        if out is None:
            return tensor.detach()
        out.copy_(tensor.detach())
        return out
    spec = shard_spec(tensor)
    if out is None:
        out = torch.empty(spec.global_shape, dtype=spec.dtype)
    for rank, shape, offset in _sources(spec):
        view = out[_box(shape, offset)]
        if rank == 0:
            view.copy_(local_of(tensor))
            continue
        target = view if view.is_contiguous() and view.device == comm_device() else None
        flat = _receive_parts(rank, shape, spec.dtype, bucket_bytes, target)
        if target is None:
            view.copy_(flat.view(shape))
    return out


def _receive_parts(
    rank: int, shape: tuple[int, ...], dtype: torch.dtype, bucket_bytes: int, target: torch.Tensor | None
) -> torch.Tensor:
    """Receive ``rank``'s box (as :func:`send_own_shard` sends it) into ``target``, or a new flat tensor."""
    flat = (
        target.reshape(-1) if target is not None else torch.empty(math.prod(shape), dtype=dtype, device=comm_device())
    )
    with collective_step(f"receiving rank {rank}'s shards for the checkpoint", CheckpointWriteError):
        for part in _chunks(flat, bucket_bytes):
            with released_by_backend(part):
                dist.recv(part, src=rank)
    return flat


def full_pieces(tensor: torch.Tensor, scratch: Scratch, *, bucket_bytes: int) -> Iterator[torch.Tensor]:
    """Rank 0's side of streaming ``tensor``'s full value: contiguous CPU tensors whose bytes, in order, are the
    full tensor's (row-major). Collective in pairs with :func:`send_own_shard` on the other ranks.

    Each piece is valid until the next one is asked for (it lives in ``scratch``, at most ``bucket_bytes``):
    write it out, then ask. Rank 0's own box comes as it is, no copy. Where some box is not one contiguous
    run of the full tensor (a shard on a later dimension), the full tensor is assembled in ``scratch`` first.
    """
    if not is_dtensor(tensor):
        yield tensor.detach().cpu().contiguous()
        return
    spec = shard_spec(tensor)
    sources = _sources(spec)
    starts = [flat_range(spec.global_shape, shape, offset) for _, shape, offset in sources]
    if any(start is None for start in starts):
        out = scratch.take(spec.global_shape, spec.dtype)
        full = gather_full(tensor, out, bucket_bytes=bucket_bytes)
        assert full is not None
        yield full.cpu()
        return
    for _, (rank, shape, _offset) in sorted(zip(starts, sources), key=lambda pair: pair[0] or 0):
        if rank == 0:
            yield local_of(tensor).detach().contiguous().cpu().reshape(-1)
            continue
        numel = math.prod(shape)
        step = max(1, bucket_bytes // spec.dtype.itemsize)
        for start in range(0, numel, step):
            part = scratch.take((min(step, numel - start),), spec.dtype)
            with collective_step(f"receiving rank {rank}'s shards for the checkpoint", CheckpointWriteError):
                with released_by_backend(part):
                    dist.recv(part, src=rank)
            yield part.cpu()
