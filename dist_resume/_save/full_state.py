"""One ordinary torch file from an FSDP2 run (``full_state=True``, :func:`save_full`): every rank's shards streamed to
rank 0, which writes as they come.

:func:`save_full_state` is ``torch.save`` of a state holding DTensors (an FSDP2 model's state dict, its
optimizer's), without the full state ever existing anywhere: rank 0 pickles the structure, then for
each tensor receives the boxes it lacks into one reusable buffer of at most ``bucket_bytes``, writes
them, and reuses the buffer (:func:`dist_resume._dist.shard_comm.full_pieces`); the other ranks only
send their boxes. The result loads with ``torch.load(weights_only=True)`` into a plain or DDP model.

If the write fails on rank 0 (disk full, ...) it keeps receiving until every rank has sent everything,
so no rank is left blocked in a send, and every rank then raises the same error.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import CheckpointWriteError
from .._core.location import Location
from .._core.log import file_size, log_rank0, log_saved, logger
from .._core.shards import is_dtensor, local_of
from .._dist.broadcast import DEFAULT_BUCKET_BYTES
from .._dist.comm import all_gather_objects, collective_step, comm_device, run_on_rank0
from .._dist.env import is_distributed
from .._dist.shard_comm import Scratch, full_pieces, send_own_shard
from .._format.atomic import atomic_write
from .._format.stream_write import distinct_tensors, write_streamed
from .sharded import agree_step

__all__ = ["save_full_state", "save_full"]


def _signature(tensors: list[torch.Tensor]) -> str:
    """What every rank must agree on before streaming: the DTensors' shapes and dtypes, in order (plain tensors
    are rank 0's own, written without a message, so the other ranks' may differ: RNG states gathered on rank 0)."""
    spec = [(tuple(t.shape), str(t.dtype)) for t in tensors if is_dtensor(t)]
    return f"{len(spec)}:{hashlib.sha256(pickle.dumps(spec)).hexdigest()[:16]}"


def save_full_state(path: Location, state: Any, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Location:
    """Save ``state`` as one torch zip file on global rank 0, tensor by tensor; return its path.

    Collective: call it on every rank with states holding the same DTensors in the same order (each rank's
    own state dicts); the file holds rank 0's plain values and plain tensors and, for each DTensor, its full
    value gathered from the ranks that hold it. Rank 0 holds at most ``bucket_bytes`` beyond
    its own shards, the other ranks nothing beyond theirs. Written atomically (a temporary file, then
    ``os.replace``); every rank returns once the file is in place, or raises rank 0's
    :class:`CheckpointWriteError`. Outside torch.distributed it is a streaming ``torch.save``.

    Example::

        >>> model = torch.nn.Linear(2, 2)  # under FSDP2, its parameters are DTensors
        >>> save_full_state(Path("full.pt"), {"model": model.state_dict()})
        PosixPath('full.pt')
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    tensors = distinct_tensors(state)
    if not is_distributed():  # one rank (a DTensor on a 1-rank mesh holds all of its value locally)
        return atomic_write(path, lambda f: _stream(f, state, _whole_local))
    with collective_step("checking that every rank saves the same state", CheckpointWriteError):
        signatures = all_gather_objects(_signature(tensors))
    if len(set(signatures)) > 1:
        raise CheckpointWriteError(
            f"the ranks' states differ (DTensor count:hash per rank {signatures}), so rank 0 cannot gather them "
            "into one file; call save_full_state on every rank with the same model and optimizer structure"
        )
    if dist.get_rank() != 0:
        for tensor in tensors:
            send_own_shard(tensor, bucket_bytes=bucket_bytes)
        result: Location = run_on_rank0(lambda: None, task=f"write {str(path)!r}")
        return result
    return run_on_rank0(lambda: _write_on_rank0(path, state, tensors, bucket_bytes), task=f"write {str(path)!r}")  # type: ignore[no-any-return]


def _whole_local(_: int, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    yield (local_of(tensor) if is_dtensor(tensor) else tensor).detach().cpu().contiguous()


def _stream(f: Any, state: Any, pieces: Any) -> None:
    write_streamed(f.fileno(), state, pieces)


def _write_on_rank0(path: Location, state: Any, tensors: list[torch.Tensor], bucket_bytes: int) -> Location:
    scratch = Scratch(comm_device())
    streams: dict[int, Iterator[torch.Tensor]] = {}

    def pieces(i: int, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        streams[i] = full_pieces(tensor, scratch, bucket_bytes=bucket_bytes)
        return streams[i]

    try:
        dest = atomic_write(path, lambda f: _stream(f, state, pieces))
    except BaseException:
        _drain(tensors, streams, scratch, bucket_bytes)
        raise
    log_rank0(logging.DEBUG, "saved %s, gathered tensor by tensor (buffer %d bytes)", dest, scratch.nbytes)
    return dest


def _drain(
    tensors: list[torch.Tensor], streams: dict[int, Iterator[torch.Tensor]], scratch: Scratch, bucket_bytes: int
) -> None:
    """Receive what the other ranks still send after a failed write, so that none waits in a send forever."""
    try:
        for i, tensor in enumerate(tensors):
            for _ in streams.get(i) or full_pieces(tensor, scratch, bucket_bytes=bucket_bytes):
                pass
    except Exception as err:  # a broken connection: the others fail in their sends too
        logger.warning("after the failed write, the other ranks' shards could not be drained: %s", err)


def save_full(
    path: Location,
    build: Callable[[], dict[str, Any]],
    *,
    step: int | None,
    epoch: int | None,
    started: float | None = None,
) -> Location:
    """One ordinary torch file from an FSDP2 model (``full_state=True``), gathered tensor by tensor. Collective.

    Every rank builds its payload (agreed before anything streams); rank 0 writes the file atomically through
    :func:`save_full_state`, holding at most one bucket beyond its own shards. Rank 0 logs the save's line, its time
    counted from ``started`` (this call's start when None).
    """
    began = time.perf_counter() if started is None else started
    dest = path
    error: BaseException | None = None
    payload: dict[str, Any] = {}
    try:
        payload = build()
    except Exception as err:
        error = err
    agree_step(error, None, "preparing the save", dest, None)
    written = save_full_state(dest, payload, bucket_bytes=DEFAULT_BUCKET_BYTES)
    if not dist.is_initialized() or dist.get_rank() == 0:  # the file's one stat, on the rank that logs
        size = file_size(written)
        log_saved(written, step=step, epoch=epoch, size=size, seconds=time.perf_counter() - began)
    return written
