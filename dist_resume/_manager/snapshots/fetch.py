"""A snapshot that only other nodes hold, brought to rank 0's node over the process group before a resume.

A DDP resume from memory needs the snapshot on every node, or on rank 0's node (rank 0 reads it and sends it:
``broadcast_from_rank0``). When rank 0 runs on a node whose memory lacks the newest snapshot (a machine replaced, and
torchrun numbered the ranks anew) while another node still holds it, :func:`fetch_to_rank0` moves the file: the
holder's rank sends it in chunks of :data:`CHUNK_BYTES` (point to point, on a gloo group made once), rank 0 writes it
into its node's shared memory as a snapshot of the same step, checks its size and CRC-32 against the holder's record
before committing it, and the ranks agree on the outcome. Every other rank only takes part in that agreement.
"""

from __future__ import annotations

import io
from typing import Any, Final

import torch
import torch.distributed as dist

from ..._core.errors import CheckpointCorruptError, CheckpointWriteError
from ..._core.location import Location
from ..._dist.agree import first_failure
from ..._dist.comm import Outcome, all_gather_objects, collective_step
from ..._dist.groups import gloo_group
from ..._shm import Snapshot, begin_snapshot

__all__ = ["CHUNK_BYTES", "fetch_to_rank0"]

CHUNK_BYTES: Final = 64 << 20
"""The bytes sent at a time; the memory each of the two ranks holds for the transfer."""

_group: tuple[Any, Any] = (None, None)  # (the default process group, the transfer group made for it)


def _transfer_group() -> Any:
    global _group
    if _group[0] is not dist.group.WORLD:
        with collective_step("making the process group of the snapshot transfer", CheckpointWriteError):
            _group = (dist.group.WORLD, gloo_group())
    return _group[1]


def _chunks(size: int) -> list[int]:
    return [min(CHUNK_BYTES, size - start) for start in range(0, size, CHUNK_BYTES)]


def _send(snapshot: Snapshot, group: Any) -> None:
    """The holder: every chunk of the file, zeros in place of what it cannot read (the error is raised after, so that
    rank 0 is never left waiting)."""
    buffer = bytearray(min(CHUNK_BYTES, max(snapshot.size, 1)))
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    error: OSError | None = None
    try:
        f: io.FileIO | None = open(snapshot.path, "rb", buffering=0)  # closed below, after every chunk
    except OSError as err:
        f, error = None, err
    try:
        for n in _chunks(snapshot.size):
            if f is not None and error is None:
                try:
                    got = f.readinto(memoryview(buffer)[:n])
                    if got != n:
                        error = OSError(f"{snapshot.path} ended after {got} of a chunk's {n} bytes")
                except OSError as err:
                    error = err
            if error is not None:
                buffer[:n] = bytes(n)
            dist.send(tensor[:n], dst=0, group=group)
    finally:
        if f is not None:
            f.close()
    if error is not None:
        raise CheckpointCorruptError(f"reading the snapshot {str(snapshot.path)!r} to send it failed: {error}")


def _receive(folder: Location, snapshot: Snapshot, holder: int, group: Any) -> Snapshot:
    """Rank 0: every chunk, written into a new snapshot of the same step (drained when the write fails), committed
    once its size and CRC-32 are the holder's."""
    buffer = bytearray(min(CHUNK_BYTES, max(snapshot.size, 1)))
    tensor = torch.frombuffer(buffer, dtype=torch.uint8)
    chunks = _chunks(snapshot.size)
    received = 0

    def dump(f: Any) -> None:
        nonlocal received
        for n in chunks:
            dist.recv(tensor[:n], src=holder, group=group)
            received += 1
            f.write(memoryview(buffer)[:n])

    try:
        pending = begin_snapshot(
            folder,
            snapshot.step,
            dump,
            size_hint=snapshot.size,
            metadata=dict(snapshot.metadata),
            identity=snapshot.identity,
        )
    finally:
        for n in chunks[received:]:  # the write failed: the holder still sends them all
            dist.recv(tensor[:n], src=holder, group=group)
    if (pending.size, pending.crc32) != (snapshot.size, snapshot.crc32):
        pending.abort()
        raise CheckpointCorruptError(
            f"the snapshot of step {snapshot.step} sent by rank {holder} arrived as {pending.size} bytes with CRC-32 "
            f"{pending.crc32}, its record says {snapshot.size} bytes, {snapshot.crc32:08x}"
        )
    return pending.commit()


def fetch_to_rank0(folder: Location, snapshot: Snapshot, holder: int) -> Snapshot | None:
    """Copy ``snapshot`` (rank ``holder``'s node's, as every rank learned it) into rank 0's node's shared memory.
    Collective: every rank calls it; rank ``holder`` sends, rank 0 receives. Returns rank 0's committed copy on rank 0,
    None on the other ranks; a failure on either side is the same :class:`CheckpointCorruptError` (or the failing
    rank's dist_resume error) on every rank, and rank 0's node keeps nothing of it."""
    group = _transfer_group()
    rank = dist.get_rank()
    error: BaseException | None = None
    copy: Snapshot | None = None
    try:
        if rank == holder:
            _send(snapshot, group)
        elif rank == 0:
            copy = _receive(folder, snapshot, holder, group)
    except Exception as err:
        error = err
    mine = Outcome() if error is None else Outcome.failed(rank, error)
    with collective_step("agreeing that the snapshot reached rank 0's node", CheckpointCorruptError):
        outcomes: list[Outcome] = all_gather_objects(mine, group=group)
    agreed = first_failure(outcomes, CheckpointCorruptError, "could not bring the snapshot to rank 0's node")
    if agreed is not None:
        raise agreed from error
    return copy
