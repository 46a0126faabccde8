"""Which snapshot a resume takes: the newest that every rank can restore from some node's shared memory, and freeing
the ones a resume did not need."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..._core.location import Location
from ..._core.log import log_rank0, shown_path
from ..._dist.comm import all_gather_objects
from ..._dist.env import is_distributed, rank_info
from ..._memory import Snapshot, newest_snapshot, remove_snapshots, snapshots
from ..._memory.place import shm_root

__all__ = ["MemoryChoice", "choose_snapshot", "forget_stale"]


@dataclass(frozen=True)
class MemoryChoice:
    """The snapshot every rank resumes from: its step, the file this rank reads (rank 0's under ``broadcast``: rank 0's
    node holds it and another does not, so rank 0 reads and sends), this rank's own copy if its node holds it, and
    whether rank 0 sends it."""

    step: int
    path: Location
    own: Snapshot | None
    broadcast: bool


def choose_snapshot(folder: Location, folder_step: int | None) -> MemoryChoice | None:
    """The newest snapshot of ``folder`` that can restore every rank and is at least as new as the folder's newest
    checkpoint (``folder_step``), or None. Collective under torch.distributed (one all-gather).

    Every rank lists its node's complete snapshots (CRC-32 checked); a step every rank holds is read by every rank from
    its own node, a step only rank 0's node holds is read by rank 0 and broadcast (a node replaced). A damaged snapshot
    is never chosen (one WARNING)."""
    mine = _complete_steps(folder)
    everyone: list[dict[int, Snapshot]] = all_gather_objects(mine) if is_distributed() else [mine]
    floor = -1 if folder_step is None else folder_step
    everywhere = set(everyone[0]).intersection(*everyone[1:])
    on_rank0 = set(everyone[0])
    best = max((s for s in everywhere if s >= floor), default=None)
    sent = max((s for s in on_rank0 if s >= floor), default=None)
    if sent is not None and (best is None or sent > best):
        return MemoryChoice(sent, everyone[0][sent].path, mine.get(sent), broadcast=is_distributed())
    if best is None:
        if any(s > floor for held in everyone for s in held):
            log_rank0(
                logging.WARNING,
                "shared memory holds a snapshot of %s newer than its newest checkpoint, but not on rank 0's node nor on "
                "every node: resuming from the folder",
                shown_path(folder),
            )
        return None
    return MemoryChoice(best, mine[best].path, mine[best], broadcast=False)


def _complete_steps(folder: Location) -> dict[int, Snapshot]:
    """This node's newest complete snapshot of ``folder`` by its step (CRC-32 checked: a damaged one gives way to the
    other slot's, with one WARNING); ``{}`` without shared memory."""
    newest = newest_snapshot(folder, verify=True) if shm_root() is not None else None
    return {} if newest is None else {newest.step: newest}


def forget_stale(folder: Location) -> None:
    """After a resume that took no snapshot, every node's local rank 0 frees the snapshots it no longer needs (none is
    newer than the folder's newest checkpoint). Local."""
    if rank_info().local_rank == 0 and shm_root() is not None and snapshots(folder):
        remove_snapshots(folder)
