"""An FSDP2 model's snapshots: every rank keeps its own shards in a part of its own in its node's shared memory.

Under FSDP2 no rank holds the whole state, so there is no node writer: rank ``r`` writes its part ``shards-<r>``
(:func:`own_part`), the standard torch file :func:`~dist_resume._foreign.own_shards.own_shards` describes (its DTensors'
local tensors, each one's box, and its train state: the RNG streams and data positions of every rank, the scheduler,
the scaler), double-buffered and committed like any snapshot (:mod:`dist_resume._shm`). The ranks agree before
anything is committed: a failure on one rank leaves the previous snapshot the newest on every rank.

A restart resumes from memory when every rank finds its own part at one step (each rank reads its own file, so
nothing crosses the network, and nothing can be sent from another node either: a rank whose shards are gone, a node
replaced, makes the job resume from the folder). ``save(step)`` of a step every rank holds writes the sharded
checkpoint folder ``ckpt_<step>.dcp`` from the snapshots (the live DTensors' specs around the saved local tensors: no
copy from the device), in a background thread on every rank as an asynchronous save does; ``close()`` does it now
for the newest snapshot the folder lacks. At SIGTERM (a preemption notice, torchrun stopping the workers) or an exit
without ``close()``, every rank writes the newest snapshot into the folder together, on a group of their own that
waits :data:`EXIT_WAIT_S` at most (:func:`exit_group`): when a rank is gone (the reason torchrun stops the others)
nothing is written. An exception that ends a ``with`` block, perhaps on one rank, writes nothing. The snapshots stay in
memory for the restart either way.
"""

from __future__ import annotations

from typing import Any, Final

import torch.distributed as dist

from ..._checkpoint.objects import LiveObjects
from ..._core.errors import CheckpointWriteError
from ..._core.location import Location
from ..._dist.comm import all_gather_objects, collective_step, run_on_rank0
from ..._dist.groups import gloo_group
from ..._foreign.own_shards import own_shards, with_saved_shards
from ..._foreign.sharded import split_payload
from ..._format.load import load_torch_file
from ..._save.async_save import finish_sharded_in_background, wait_pending
from ..._save.save import build_payload
from ..._save.sharded import begin_sharded_from, finish_sharded, writes_folder
from ..._shm import Snapshot, mark_persisted, snapshots
from ..._source.listing import numbered_checkpoints
from ..folder_save import SaveTarget
from .writer import Written, begin_write

__all__ = [
    "EXIT_WAIT_S",
    "own_part",
    "own_object",
    "begin_own",
    "held_everywhere",
    "persist_own",
    "persist_newest",
    "own_snapshots",
    "exit_group",
]

EXIT_WAIT_S: Final = 20.0
"""How long a collective of the copy at an unplanned end waits for a rank (torchrun gives a stopped worker 30 s)."""

_exit: tuple[Any, Any] = (None, None)  # (the default process group, the exit group made for it)


def own_part(rank: int) -> str:
    """The store's part that rank ``rank`` of an FSDP2 job writes: ``shards-00003``."""
    return f"shards-{rank:05d}"


def own_object(payload: dict[str, Any]) -> dict[str, Any]:
    """What this rank's snapshot file holds of ``payload``: its own shards and the train state. Local."""
    dcp_state, train_state = split_payload(payload)
    return own_shards(dcp_state, train_state, rank=dist.get_rank(), world_size=dist.get_world_size())


def begin_own(
    folder: Location, build: Any, step: int, epoch: int | None, live: LiveObjects, identity: str | None
) -> Written:
    """Write this rank's own shards of the payload ``build()`` returns into its part's free slot (see
    :class:`~.writer.Written`). Local (the caller agrees before committing)."""
    obj = own_object(build())
    part = own_part(dist.get_rank())
    return begin_write(folder, lambda: obj, step, epoch, None, None, live=live, part=part, identity=identity)


def held_everywhere(mine: bool) -> bool:
    """Whether every rank holds a snapshot ``save(step)`` can copy (``mine``: this rank's newest is of ``step``,
    committed, and the live state has not changed since). Collective (one all-gather): call it on every rank, whatever
    it holds."""
    with collective_step("asking every rank whether it holds the snapshot", CheckpointWriteError):
        held: list[bool] = all_gather_objects(mine)
    return all(held)


def persist_own(
    snapshot: Snapshot, target: SaveTarget, live: LiveObjects, *, background: bool, group: Any = None
) -> Location | None:
    """Write the sharded checkpoint folder of ``snapshot``'s step (each rank's own ``snapshot``) into the target's
    folder from the snapshots, then mark them copied and rotate: in a background thread on every rank
    (``background``; its error at the next call, as an asynchronous save's) or now. Collective on ``group`` (every
    rank; None: the default group, after the previous asynchronous save). None when the target saves one full file
    (``full_state=True``): a snapshot of shards cannot be copied into that without the gather a save does."""
    if not writes_folder(live.model, target.full_state):
        return None
    step = snapshot.step
    dest = target.path(live, step)
    if group is None:
        wait_pending()
    run_on_rank0(target.prepare, group=group)
    saved = load_torch_file(snapshot.path, map_location="cpu", mmap=True, weights_only=True)

    def states() -> tuple[dict[str, Any], dict[str, Any]]:
        # the live DTensors (no collective: no RNG or data position gathered), their specs around the saved local tensors
        live_state, _ = split_payload(build_payload(live, step=step))
        return with_saved_shards(live_state, saved["state"]), dict(saved["train_state"])

    epoch = snapshot.metadata.get("epoch")
    epoch = epoch if isinstance(epoch, int) else None
    begun = begin_sharded_from(dest, states, live.model, step=step, epoch=epoch, group=group)

    def after(done: Location) -> None:
        mark_persisted(snapshot)
        if dist.get_rank() == 0:
            target.rotate(done, step)

    if background:
        finish_sharded_in_background(begun, after)
    else:
        after(finish_sharded(begun, group))
    return dest


def own_snapshots(folder: Location, identity: str | None, *, verify: bool) -> dict[int, Snapshot]:
    """This rank's complete snapshots of its own shards (:func:`own_part`) of the folder's ``identity`` taken at this
    world size, by their step, both slots (``verify``: CRC-32 checked, a damaged one left out with one WARNING).
    Local."""
    world_size = dist.get_world_size()
    own = snapshots(folder, part=own_part(dist.get_rank()), verify=verify, identity=identity)
    return {s.step: s for s in own if s.metadata.get("world_size") == world_size}


def persist_newest(
    folder: Location, target: SaveTarget, live: LiveObjects | None, identity: str | None, group: Any = None
) -> bool:
    """Write the newest step every rank holds a snapshot of into the folder now (:func:`persist_own`) when it is newer
    than the folder's newest checkpoint; whether it did. Each rank's two slots count, so a rank whose newest commit did
    not end (a SIGTERM in the middle of it) still has the previous step written. Collective on ``group`` (None: the
    default group)."""
    mine = own_snapshots(folder, identity, verify=False)
    with collective_step("asking every rank for its snapshots", CheckpointWriteError):
        held: list[list[int]] = all_gather_objects(sorted(mine), group=group)
    step = max(set(held[0]).intersection(*held[1:]), default=None)
    if live is None or step is None:
        return False
    if not run_on_rank0(lambda: newer_than_folder(target, step), task="look at the checkpoint folder", group=group):
        return False
    return persist_own(mine[step], target, live, background=False, group=group) is not None


def exit_group() -> Any:
    """The gloo group an FSDP2 job's ranks write their newest snapshot into the folder on at an unplanned end (SIGTERM,
    an exit without ``close()``): every rank, waiting :data:`EXIT_WAIT_S` at most, so that a rank gone (the reason
    torchrun stops the others) costs that long and no more. Collective the first time (call it in the foreground)."""
    global _exit
    if _exit[0] is not dist.group.WORLD:
        with collective_step("making the process group of the snapshots' copy at exit", CheckpointWriteError):
            _exit = (dist.group.WORLD, gloo_group(timeout=EXIT_WAIT_S))
    return _exit[1]


def newer_than_folder(target: SaveTarget, step: int) -> bool:
    """Rank 0: whether the folder's newest checkpoint is older than ``step`` (its names)."""
    newest = max((s for s, _ in numbered_checkpoints(target.folder)), default=None)
    return newest is None or newest < step
