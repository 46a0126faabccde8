"""A snapshot's copy split across the node's local ranks: each copies its share of the records into the one slot.

Under DDP every rank holds the replicated state (the parameters, the optimizer's per-parameter state), so the node's
writer (local rank 0) need not copy all of it alone. It lays the file out, makes and sizes the slot and sends the
node's other ranks the slot's name and each one's share (:class:`NodeCopy`, one ``broadcast_object_list`` on a gloo
group of the node's ranks, made once: :func:`node_group`); each maps the slot (kept mapped across snapshots,
:func:`~dist_resume._shm.attach_slot`) and copies its share from its own tensors, found by their paths, while the
writer copies its own. The shares are balanced by bytes as a striped save's
(:func:`~dist_resume._save.striped_plan.assign_shares`): only the large records of what DDP keeps identical on every
rank are spread; the pickle, the buffers, the EMA, ``extra``, the RNG streams and the data position stay with the
writer. Every rank's outcome is then agreed on before the writer commits (:mod:`.outcome`): a failure on any of them
and the snapshot is not committed. A state under :data:`SPLIT_MIN_BYTES` is copied by the writer alone: the plan's
broadcast costs more than the copy it would share.

``DIST_RESUME_SNAPSHOT_WRITER_ONLY=1`` (read at import; :data:`writer_only`) makes the writer copy everything: the
benchmark and the tests compare.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

from ..._core.errors import CheckpointWriteError
from ..._dist.comm import all_gather_objects, broadcast_object, collective_step
from ..._dist.env import rank_info
from ..._dist.groups import gloo_group
from ..._format.striped_archive import find_tensor
from ..._save.striped_plan import assign_shares, is_ddp, replicated_paths
from ..._shm import attach_slot
from ..._state.sharded import is_sharded
from .payload import CopyRecord, LaidOut, copy_records, copyable

__all__ = [
    "WRITER_ONLY_ENV",
    "SPLIT_MIN_BYTES",
    "NodeCopy",
    "splits",
    "node_group",
    "shares_of",
    "send",
    "receive",
    "copy_share",
]

WRITER_ONLY_ENV: Final = "DIST_RESUME_SNAPSHOT_WRITER_ONLY"
"""Private switch, read once at import: ``1`` makes the node's writer copy a snapshot alone."""

writer_only: bool = os.environ.get(WRITER_ONLY_ENV, "") == "1"

SPLIT_MIN_BYTES: int = 64 << 20
"""The replicated bytes (parameters and optimizer state) from which the node's ranks share the copy: below it, one
object broadcast to the node (milliseconds on gloo) costs more than the copy saved (tests set it to 0)."""


@dataclass(frozen=True, slots=True)
class NodeCopy:
    """What the node's writer sends its local ranks: the slot's data file, its size, each local rank's records."""

    slot: str
    size: int
    shares: tuple[tuple[CopyRecord, ...], ...]


def _replicated_bytes(model: nn.Module, optimizer: Any) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in getattr(optimizer, "state", {}).values():
        total += sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
    return total


def splits(model: nn.Module | None, optimizer: Any = None) -> bool:
    """Whether a snapshot of ``model`` (and ``optimizer``'s state) is copied by every local rank: a DDP model (not
    FSDP2-sharded) with more than one rank on the node and at least :data:`SPLIT_MIN_BYTES` of parameters and
    optimizer state, the private switch off. Local; the same answer on every rank (DDP keeps them the same)."""
    info = rank_info()
    return (
        not writer_only
        and info.local_world_size > 1
        and dist.is_initialized()
        and model is not None
        and not is_sharded(model)
        and is_ddp(model)
        and _replicated_bytes(model, optimizer) >= SPLIT_MIN_BYTES
    )


_groups: tuple[Any, Any] = (None, None)  # (the default process group, this node's group made for it)


def node_group() -> Any:
    """A gloo process group of this node's ranks (collective the first time: every node's group is made by every
    rank). A node's ranks are the ones with the same ``rank - local_rank``, as torchrun numbers them."""
    global _groups
    if _groups[0] is not dist.group.WORLD:
        info = rank_info()
        with collective_step("making a process group of each node's ranks", CheckpointWriteError):
            bases: list[int] = all_gather_objects(dist.get_rank() - info.local_rank)
            nodes = [[r for r, b in enumerate(bases) if b == base] for base in sorted(set(bases))]
            mine = None
            for ranks in nodes:  # every group made by every rank, in the same order
                group = gloo_group(ranks)
                if dist.get_rank() in ranks:
                    mine = group
        _groups = (dist.group.WORLD, mine)
    return _groups[1]


def shares_of(laid: LaidOut, model: nn.Module, local_world_size: int) -> tuple[tuple[CopyRecord, ...], ...]:
    """Each local rank's records of ``laid``, balanced by bytes (the writer's first, with the fixed bytes). Local."""
    fixed = sum(len(data) for _, data in laid.layout.fixed)
    return assign_shares(laid.records, replicated_paths(model), local_world_size, fixed)


def send(plan: NodeCopy | None, group: Any) -> None:
    """On the node's writer: send ``plan`` (None: nothing to copy, the writer failed or saves whole) to the node."""
    with collective_step("sending the snapshot's slot to the node's ranks", CheckpointWriteError):
        broadcast_object(plan, src=dist.get_rank(), group=group)


def receive(group: Any) -> NodeCopy | None:
    """On the node's other ranks: the writer's :class:`NodeCopy` (see :func:`send`)."""
    writer = dist.get_rank() - rank_info().local_rank
    with collective_step("receiving the snapshot's slot from the node's writer", CheckpointWriteError):
        plan = broadcast_object(None, src=writer, group=group)
    return plan if isinstance(plan, NodeCopy) else None


def _mismatch(record: CopyRecord, found: torch.Tensor | None) -> CheckpointWriteError:
    path = "".join(f"[{key!r}]" for key in record.path)
    what = "nothing" if found is None else f"{type(found).__name__} {found.dtype} {tuple(found.shape)}"
    return CheckpointWriteError(
        f"snapshot: payload{path} is {record.dtype} {record.shape} on the node's writer but {what} on rank "
        f"{dist.get_rank()}; under DDP every rank must hold the same model and optimizer state (was the optimizer "
        "stepped on some ranks only?); the snapshot was not taken"
    )


def copy_share(payload: dict[str, Any], plan: NodeCopy) -> int:
    """On a local rank other than the writer: copy this rank's share of ``plan`` from its own ``payload`` into the
    slot; the bytes copied. Raises :class:`CheckpointWriteError` when a tensor differs from the writer's, ``OSError``
    when the slot cannot be mapped."""
    share = plan.shares[rank_info().local_rank]
    if not share:
        return 0
    copies = []
    for record in share:
        found = find_tensor(payload, record.path)
        if found is None or not copyable(found) or (found.dtype, tuple(found.shape)) != (record.dtype, record.shape):
            raise _mismatch(record, found)
        copies.append((record, found))
    return copy_records(attach_slot(Path(plan.slot), plan.size), copies)
