"""Which snapshot a resume takes: the newest that every rank can restore from some node's shared memory (of the
folder's identity, its content usable: :mod:`.usable`), and freeing the ones a resume did not need."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch.distributed as dist

from ..._core.errors import DistResumeError
from ..._core.location import Location
from ..._core.log import log_rank0, logger, shown_path
from ..._core.rank import global_rank
from ..._dist.comm import all_gather_objects
from ..._dist.env import is_distributed, rank_info
from ..._shm import Snapshot, newest_snapshot, remove_snapshots, remove_stale, snapshots
from ..._shm.place import shm_root
from .fetch import fetch_to_rank0
from .shards import own_part
from .usable import snapshot_problem

__all__ = ["MemoryChoice", "choose_snapshot", "forget_stale"]


@dataclass(frozen=True)
class MemoryChoice:
    """The snapshot every rank resumes from: its step, the file this rank reads (rank 0's under ``broadcast``: rank 0's
    node holds it and another does not, so rank 0 reads and sends), this rank's own copy if its node holds it, and
    whether rank 0 sends it; the folder's identity."""

    step: int
    path: Location
    own: Snapshot | None
    broadcast: bool
    identity: str
    sharded: bool = False  # FSDP2: ``path`` is this rank's own shards (:mod:`.shards`)


def choose_snapshot(
    folder: Location, folder_step: int | None, identity: str | None, *, sharded: bool = False
) -> MemoryChoice | None:
    """The newest snapshot of ``folder`` that can restore every rank and is at least as new as the folder's newest
    checkpoint (``folder_step``), or None. Collective under torch.distributed (one all-gather).

    Only snapshots of the folder's ``identity`` count (None: the folder has none, and none counts): each node's local
    rank 0 first removes the others, with one WARNING (:func:`~dist_resume._shm.remove_stale`). Every rank lists its
    node's complete snapshots (CRC-32 checked, content usable: :func:`~.usable.snapshot_problem`; one that is not
    gives way to the slot before it, with one WARNING); a step every rank holds is read by every rank from
    its own node, a step only rank 0's node holds is read by rank 0 and broadcast (a node replaced), and a newer step
    only other nodes hold is first copied into rank 0's node's memory over the process group, then read by rank 0 and
    broadcast (a node replaced where rank 0 now runs). A damaged snapshot is never chosen (one WARNING). ``sharded`` (an FSDP2 model): each rank lists its own part's snapshots, both slots,
    taken at this world size, and only a step every rank holds is chosen (no rank holds another's shards)."""
    if shm_root() is not None and rank_info().local_rank == 0:
        remove_stale(folder, identity)
    mine = _own_steps(folder, identity) if sharded else _complete_steps(folder, identity)
    everyone: list[dict[int, Snapshot]] = all_gather_objects(mine) if is_distributed() else [mine]
    floor = -1 if folder_step is None else folder_step
    everywhere = set(everyone[0]).intersection(*everyone[1:])
    on_rank0 = set() if sharded else set(everyone[0])
    best = max((s for s in everywhere if s >= floor), default=None)
    sent = max((s for s in on_rank0 if s >= floor), default=None)
    newest = max((s for held in everyone for s in held if s >= floor), default=None)
    if not sharded and newest is not None and newest not in on_rank0 and (best is None or newest > best):
        fetched = _fetched(folder, everyone, newest)  # only other nodes hold it: bring it to rank 0's node first
        if fetched is not None:
            own = fetched if global_rank() == 0 else mine.get(newest)
            return MemoryChoice(newest, fetched.path, own, True, fetched.identity)
    if sent is not None and (best is None or sent > best):
        rank0 = everyone[0][sent]
        return MemoryChoice(sent, rank0.path, mine.get(sent), is_distributed(), rank0.identity)
    if best is None:
        if any(s > floor for held in everyone for s in held):
            log_rank0(
                logging.WARNING,
                "shared memory holds a snapshot of %s newer than its newest checkpoint, but %s: resuming from the folder",
                shown_path(folder),
                "not every rank's shards of one step (an FSDP2 rank restores from its own only)"
                if sharded
                else "not on every node, and it could not be brought to rank 0's",
            )
        return None
    return MemoryChoice(best, mine[best].path, mine[best], False, mine[best].identity, sharded=sharded)


def _fetched(folder: Location, everyone: list[dict[int, Snapshot]], step: int) -> Snapshot | None:
    """The snapshot of ``step``, which only nodes other than rank 0's hold, copied into rank 0's node's memory from the
    lowest rank that holds it (:func:`~.fetch.fetch_to_rank0`); rank 0's copy (the holder's record on the other ranks),
    or None with one WARNING when the transfer failed. Collective."""
    holder = min(rank for rank, held in enumerate(everyone) if step in held)
    try:
        copy = fetch_to_rank0(folder, everyone[holder][step], holder)
    except DistResumeError as err:
        log_rank0(
            logging.WARNING,
            "the snapshot of step %d of %s is on rank %d's node only and could not be brought to rank 0's (%s)",
            step,
            shown_path(folder),
            holder,
            err,
        )
        return None
    return copy if copy is not None else everyone[holder][step]


def _complete_steps(folder: Location, identity: str | None) -> dict[int, Snapshot]:
    """This node's newest complete snapshot of ``folder`` by its step (CRC-32 checked, content usable: one that is not
    gives way to the other slot's, with one WARNING); ``{}`` without shared memory."""
    if shm_root() is None:
        return {}
    newest = newest_snapshot(folder, verify=True, identity=identity, usable=snapshot_problem)
    return {} if newest is None else {newest.step: newest}


def _own_steps(folder: Location, identity: str | None) -> dict[int, Snapshot]:
    """This rank's complete snapshots of its own shards (:func:`~.shards.own_part`) taken at this world size, by their
    step, both slots (CRC-32 checked, content usable: one that is not left out with one WARNING); ``{}`` without shared
    memory."""
    if shm_root() is None:
        return {}
    world_size = dist.get_world_size()
    own = snapshots(folder, part=own_part(global_rank()), verify=True, identity=identity)
    other = sorted({s.metadata.get("world_size") for s in own} - {world_size}, key=str)
    if other:
        log_rank0(
            logging.WARNING,
            "shared memory holds FSDP2 snapshots of %s taken at world size %s, which cannot restore %d ranks (each "
            "rank's shards are its own): resuming from the folder; relaunch at that world size to resume from them",
            shown_path(folder),
            ", ".join(map(str, other)),
            world_size,
        )
    usable = {}
    for snapshot in own:
        if snapshot.metadata.get("world_size") != world_size:
            continue
        why = snapshot_problem(snapshot, shards_of=(global_rank(), world_size))
        if why is None:
            usable[snapshot.step] = snapshot
        else:
            logger.warning("ignoring the snapshot of step %d in %s: %s", snapshot.step, snapshot.path, why)
    return usable


def forget_stale(folder: Location, folder_step: int | None, identity: str | None) -> None:
    """After a resume that took no snapshot, every node's local rank 0 frees its snapshots when none is newer than the
    folder's newest checkpoint (``folder_step``; None: the folder holds none, or none with a step). Snapshots newer
    than it are kept (the resume could not use them: another world size, a node without them, shards that did not
    fit; a WARNING said so), for the relaunch that can. Local."""
    if rank_info().local_rank != 0 or shm_root() is None:
        return
    held = snapshots(folder, identity=identity)
    if held and folder_step is not None and all(s.step <= folder_step for s in held):
        remove_snapshots(folder)
