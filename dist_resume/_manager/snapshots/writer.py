"""The node's writer begins a snapshot: its payload laid out and copied into the free slot (the node's other ranks
copying their shares at the same time when the copy is split), or saved with ``torch.save`` when the copy cannot take
a tensor; what it holds is kept as evidence (:mod:`.evidence`). The commit is the caller's."""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..._checkpoint.objects import LiveObjects
from ..._core.location import Location
from ..._core.tree import iter_tensors
from ..._dist.env import is_distributed, rank_info
from ..._shm import PendingSnapshot, begin_copy, begin_snapshot, size_estimate
from .evidence import Evidence
from .payload import CopyRecord, copy_records, laid_out
from .split import NodeCopy, send, shares_of

__all__ = ["Written", "begin_write"]


class Written(NamedTuple):
    """A snapshot begun: the pending snapshot to commit, the tensor bytes this process copied, and what it holds
    (None when it was saved with ``torch.save``: nothing to compare with)."""

    pending: PendingSnapshot
    copied: int
    evidence: Evidence | None


def begin_write(
    folder: Location,
    build: Callable[[], dict[str, Any]],
    step: int,
    epoch: int | None,
    model: nn.Module | None,
    group: Any,
    *,
    live: LiveObjects | None = None,
    part: str = "state",
    identity: str | None = None,
) -> Written:
    """Write the payload ``build()`` returns into the free slot of ``folder``'s snapshots (see :class:`Written`). With
    ``group`` (the node's ranks, the copy split: :mod:`~dist_resume._manager.snapshots.split`) the other ranks are sent
    their shares (None when there is nothing for them to copy: the writer failed before the
    slot was ready, or the payload is saved whole), collective on ``group`` then. Local otherwise. ``part``: the
    store's part written (an FSDP2 rank's own, :mod:`~dist_resume._manager.snapshots.shards`); ``identity``: the folder's
    (None: the one it keeps, made when it has none); ``live``: the objects the payload was built from, whose tensors' counters and optimizer's steps the evidence records (None: no evidence)."""
    world_size = dist.get_world_size() if is_distributed() else 1
    metadata = {"world_size": world_size, "epoch": epoch}
    sent = False
    try:
        payload = build()
        laid = laid_out(payload, paths=group is not None and model is not None)
        if laid is None:  # a tensor the copy cannot take: torch.save into a new file
            if group is not None:
                sent = True
                send(None, group)
            tensors = list(iter_tensors(payload))
            size = size_estimate(sum(t.untyped_storage().nbytes() for t in tensors), len(tensors))
            pending = begin_snapshot(
                folder,
                step,
                lambda f: torch.save(payload, f),
                size_hint=size,
                part=part,
                metadata=metadata,
                identity=identity,
            )
            return Written(pending, 0, None)
        shares: tuple[tuple[CopyRecord, ...], ...] = (laid.records,)
        if group is not None and model is not None:
            shares = shares_of(laid, model, rank_info().local_world_size)
        copied = 0

        def fill(path: Path, mm: mmap.mmap) -> None:
            nonlocal sent, copied
            if group is not None:
                sent = True
                send(NodeCopy(str(path), laid.layout.size, shares), group)
            copied = copy_records(mm, ((r, laid.tensors[r.index]) for r in shares[0]))

        pending = begin_copy(folder, step, laid.layout, fill, part=part, metadata=metadata, identity=identity)
        evidence = None if live is None else Evidence.of(step, payload, laid, pending.path, live)
        return Written(pending, copied, evidence)
    except BaseException:
        if group is not None and not sent:  # the node's ranks wait for the slot: nothing comes (this error says why)
            with contextlib.suppress(Exception):
                send(None, group)
        raise
