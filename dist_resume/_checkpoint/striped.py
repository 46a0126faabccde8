"""A striped resume: every rank reads a local torch file's structure, then only its share of the tensor data, and the
ranks exchange the shares over the process group into their live tensors.

The default for a collective resume of a local torch file (:func:`stripes`): each rank reads the archive's structure
(:func:`~dist_resume._source.read.read_source` with ``striped``: the directory, the small records and the pickle, with
meta stand-ins), plans and validates as usual and the ranks agree; ``verify=True`` has each rank check the CRC-32 of its
share of the records first (:func:`check_share`). Apply reads the few tensors its steps need on every rank
(:func:`~.ranged.read_early`); at the commit the tensor records are split into one share per rank, balanced by bytes,
each owner reads its share straight into its live tensors and broadcasts it to the others
(:func:`~dist_resume._dist.striped_exchange.exchange`, bucketed, on the accelerator under NCCL). No rank maps or reads
the whole file; what each holds beyond its live tensors is one bucket. A failure on one rank during the exchange is
:class:`~dist_resume.errors.PartialRestoreError` on every rank, as under ``broadcast_from_rank0``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError
from .._core.location import RemotePath
from .._core.log import log_rank0
from .._dist.accelerator import backend_serves, current_device
from .._dist.broadcast import DEFAULT_BUCKET_BYTES
from .._dist.comm import all_gather_objects, collective_step, comm_device
from .._dist.striped_exchange import Unit, exchange, owners_by_bytes
from .._format.ranged import RangedArchive
from .._source.source import Source
from .apply.step import Pairs
from .apply.transaction import Agree, Transfer, copy_pairs
from .options import ResumeOptions
from .plan.restore_plan import RestorePlan
from .ranged import read_early

__all__ = ["every_rank_reads", "stripes", "check_share", "apply_striped"]

_EVERY_RANK: ContextVar[bool] = ContextVar("dist_resume_every_rank_reads", default=False)


@contextlib.contextmanager
def every_rank_reads() -> Iterator[None]:
    """Inside, a collective resume of a local torch file has every rank load all of it, as before striped reads
    (for benchmarks and tests). Local; every rank must enter it alike."""
    token = _EVERY_RANK.set(True)
    try:
        yield
    finally:
        _EVERY_RANK.reset(token)


def stripes(source: Source, options: ResumeOptions) -> bool:
    """Whether a resume of ``source`` reads it striped: a collective resume (more than one rank) of a local torch file
    read with ``weights_only`` onto the CPU (``map_location`` None), not ``broadcast_from_rank0``. Local: the same on
    every rank (the source was decided once, the options are every rank's)."""
    return (
        not source.broadcast
        and source.layout is None
        and not isinstance(source.path, RemotePath)
        and options.weights_only
        and options.map_location is None
        and not _EVERY_RANK.get()
        and dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() > 1
    )


def check_share(archive: RangedArchive) -> None:
    """``verify=True`` of a striped resume: this rank checks the CRC-32 of its share of the tensor records (split by
    bytes as the exchange splits them). Local; raises :class:`CheckpointCorruptError`, which the caller's agreement
    relays to every rank before anything changed."""
    records = archive.tensor_records()
    owners = owners_by_bytes([r.compress_size for r in records], dist.get_world_size())
    rank = dist.get_rank()
    for record, owner in zip(records, owners):
        if owner == rank:
            archive.check_crc(record)


def apply_striped(archive: RangedArchive | None, plan: RestorePlan, agree: Agree) -> tuple[str, ...]:
    """Apply ``plan`` (built on ``archive``'s stand-ins; None where this rank loaded a legacy file whole): what the
    steps need read on every rank, the rest exchanged at the commit. Collective. Returns the parts restored."""
    try:
        return read_early(archive, plan, agree).apply(agree=agree, transfer=_transfer(archive))
    finally:
        if archive is not None:
            archive.close()


def _wire_device(units: list[Unit]) -> torch.device:
    """Where the broadcasts run: the live tensors' accelerator where the process group serves it (NCCL for CUDA),
    else the group's device for objects (the CPU under gloo)."""
    kinds = {u.dst.device.type for u in units}
    if len(kinds) == 1 and "cpu" not in kinds:
        kind = kinds.pop()
        if any(backend_serves(part.rpartition(":")[2], kind) for part in dist.get_backend().split(",")):
            return current_device(kind)
    return comm_device()


def _digest(archive: RangedArchive | None, units: list[Unit]) -> str | None:
    """What every rank must share to exchange: the same file and the same saved tensors, in the same order."""
    if archive is None:
        return None
    shapes = [(archive.offset_of(u.saved), str(u.saved.dtype), tuple(u.saved.shape), u.saved.stride()) for u in units]
    return hashlib.sha256(repr((archive.identity(), shapes)).encode()).hexdigest()


def _transfer(archive: RangedArchive | None) -> Transfer:
    """The commit's :data:`~dist_resume._checkpoint.apply.transaction.Transfer`: the archive's tensors exchanged striped (every
    rank the same file and tensors, one all-gather says so), anything else copied here. Ranks that read different
    files (each its own copy, passed as a path) or restore different tensors each read their own instead."""

    def transfer(pairs: Pairs) -> Exception | None:
        held = [(s, d) for s, d in pairs if archive is not None and archive.holds(s)]
        order = sorted(range(len(held)), key=lambda i: (archive.offset_of(held[i][0]) if archive else 0, i))
        units = [Unit(*held[i]) for i in order]
        mine = _digest(archive, units)
        with collective_step("agreeing on the tensors to exchange", CheckpointError):
            digests = all_gather_objects(mine)
        if mine is None or any(d != mine for d in digests):
            log_rank0(logging.INFO, "the ranks restore different files or tensors: each rank reads its own")
            return copy_pairs(pairs) if archive is None else archive.transfer(pairs)
        assert archive is not None  # a digest is an archive's
        failure = exchange(units, archive, bucket_bytes=DEFAULT_BUCKET_BYTES, device=_wire_device(units))
        rest = copy_pairs([(s, d) for s, d in pairs if not archive.holds(s)])
        return failure or rest

    return transfer
