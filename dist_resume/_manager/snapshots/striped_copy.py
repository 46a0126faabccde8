"""A snapshot's copy into the folder striped across rank 0's node's ranks: each copies a range of the slot file.

The snapshot ``save(step)`` copies into ``ckpt_<step>.pt`` is one file in the shared memory of rank 0's node (another
node's snapshot may differ in its bytes, DDP's buffers for one, so files are never mixed across nodes), which every
rank of that node can read. When the folder is a local path and that node has more than one rank
(:func:`copying_ranks`), the copy is split among them by contiguous byte ranges, balanced, each boundary on 1 MiB
(:func:`byte_ranges`: no two ranks write one page). Each rank copies in a background thread of its own, on a gloo
process group of the node's ranks made once for these threads alone (:func:`copy_group`), so the training loop is
never blocked:

1. rank 0, once the snapshot is committed, creates the temporary file next to the destination, sized, and sends the
   slot's path, the size and the temporary file to the others (:func:`call_off` sends nothing to copy instead);
2. the first copy into a folder, every rank opens the temporary file and reads back rank 0's token
   (:func:`~dist_resume._save.striped.agree_seen`): when some rank cannot, rank 0 copies alone, into this and every
   later checkpoint of the folder, said once in an INFO line;
3. each rank reads its range of the slot file and writes it at the same offset into the temporary file
   (:func:`~dist_resume._shm.copy_bytes`), its CRC-32 on the way, and fsyncs;
4. rank 0 gathers every rank's CRC-32 and length or error: any error, or CRC-32s that, combined in order
   (:func:`~dist_resume._shm.crc32_combine`), are not the snapshot record's (damaged or overwritten meanwhile:
   :class:`CheckpointCorruptError`) and nothing is committed, the temporary file removed; else fsync, the rename and
   the folder's fsync (:func:`~dist_resume._format.atomic.commit_file`).

The file is byte for byte the slot file, as rank 0's copy alone writes it
(:func:`~dist_resume._shm.persist_snapshot`). Only rank 0 raises the copy's error: its caller keeps it for the next
collective call, which every rank then raises. ``DIST_RESUME_SAVE_RANK0=1``
(:data:`~dist_resume._save.striped_plan.rank0_only`) leaves every copy to rank 0, as every save.
"""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch.distributed as dist

from ..._core.errors import CheckpointWriteError
from ..._core.location import Location
from ..._dist.agree import first_failure
from ..._dist.comm import Outcome, all_gather_objects, broadcast_object, collective_step
from ..._dist.env import is_distributed, rank_info
from ..._dist.groups import gloo_group
from ..._format.atomic import commit_file, create_temp, discard_temp, write_error
from ..._format.striped_archive import STRIPE_ALIGNMENT
from ..._format.zip_write import write_all
from ..._save import striped_plan
from ..._save.striped import agree_seen
from ..._shm import Snapshot, check_copied, copy_bytes, crc32_combine, open_snapshot

__all__ = ["CopyTask", "copying_ranks", "copy_group", "byte_ranges", "copy_striped", "copy_striped_share", "call_off"]

_OPEN_FLAGS: Final = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)

_seen: dict[str, bool] = {}
"""Per folder (absolute path): whether every rank of rank 0's node saw rank 0's file there; decided once, by them."""


@dataclass(frozen=True, slots=True)
class CopyTask:
    """What rank 0 tells every rank at ``save(step)`` or ``close()``: the step of the snapshot copied into the folder
    and how many ranks copy it (ranks ``0 .. ranks - 1``, rank 0's node; 1: rank 0 alone)."""

    step: int
    ranks: int


@dataclass(frozen=True, slots=True)
class _Plan:
    """What rank 0 sends its node's copying ranks: the slot file, its size, the temporary file, the token to look for
    in it (None once every rank is known to see the folder), the step (for messages)."""

    slot: str
    size: int
    temp: str
    token: str | None
    step: int


def copying_ranks(folder: Location) -> int:
    """On rank 0: how many of its node's ranks copy a snapshot into ``folder``: every one (its local world size) for a
    local folder under torch.distributed, unless ``DIST_RESUME_SAVE_RANK0=1`` or some rank of the node was found not
    to see the folder; else 1 (rank 0 alone; an object store's upload is rank 0's). Local."""
    if not isinstance(folder, Path) or not is_distributed() or striped_plan.rank0_only:
        return 1
    if _seen.get(os.path.abspath(folder)) is False:
        return 1
    return rank_info().local_world_size


_group: tuple[Any, int, Any] = (None, 0, None)  # (the default process group, the ranks, their group made for it)


def copy_group(ranks: int) -> Any:
    """A gloo process group of ranks ``0 .. ranks - 1`` (rank 0's node, as torchrun numbers ranks) that only the
    copies' background threads use. Collective the first time (every rank makes it, in the same order: call it in the
    foreground); local afterwards."""
    global _group
    if _group[0] is not dist.group.WORLD or _group[1] != ranks:
        with collective_step("making the process group of the snapshot copies", CheckpointWriteError):
            _group = (dist.group.WORLD, ranks, gloo_group(range(ranks)))
    return _group[2]


def byte_ranges(size: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """``ranks`` contiguous ``(start, end)`` ranges covering ``size`` bytes in order, balanced, every boundary but the
    last on a multiple of 1 MiB (:data:`~dist_resume._format.striped_archive.STRIPE_ALIGNMENT`), the nearest to an
    equal split; a file of a few MiB leaves some ranks an empty range. Local.

    Example::

        >>> byte_ranges(10 << 20, 3)
        ((0, 3145728), (3145728, 7340032), (7340032, 10485760))
    """
    cuts = [0]
    for k in range(1, ranks):
        pages = (2 * size * k + ranks * STRIPE_ALIGNMENT) // (2 * ranks * STRIPE_ALIGNMENT)  # size*k/ranks, rounded
        cuts.append(min(size, pages * STRIPE_ALIGNMENT))
    cuts.append(size)
    return tuple(itertools.pairwise(cuts))


def call_off(group: Any) -> None:
    """On rank 0, when the snapshot is not there to copy (its commit failed): tell the copying ranks, which wait for
    the plan. Collective on ``group``."""
    _send(None, group)


def _send(plan: _Plan | None, group: Any) -> None:
    with collective_step("sending the snapshot's copy to the node's ranks", CheckpointWriteError):
        broadcast_object(plan, src=0, group=group)


def _begin(snapshot: Snapshot, dest: Path, check: bool) -> tuple[int, _Plan]:
    """Rank 0: the temporary file, sized (and the token in it when ``check``), and the plan."""
    try:
        fd, temp = create_temp(dest)
    except OSError as err:
        raise write_error(dest, err) from err
    token = secrets.token_hex(8) if check else None
    try:
        os.ftruncate(fd, snapshot.size)
        if token is not None:
            write_all(fd, token.encode(), 0)  # overwritten by the copy of the first bytes
    except OSError as err:
        os.close(fd)
        discard_temp(temp)
        raise write_error(dest, err) from err
    return fd, _Plan(os.path.abspath(snapshot.path), snapshot.size, str(temp), token, snapshot.step)


def _write_share(plan: _Plan, fd: int, dest: Path, share: tuple[int, int]) -> tuple[int, int]:
    """This rank's range of the slot file written at the same offset into the temporary file, then fsync; its
    CRC-32 and length."""
    src = open_snapshot(Path(plan.slot), plan.step)
    try:
        crc, n = copy_bytes(src, lambda data, offset: write_all(fd, data, offset), *share)
        os.fsync(fd)
    except OSError as err:
        raise write_error(dest, err) from err
    finally:
        os.close(src)
    return crc, n


def _copy(
    plan: _Plan, fd: int | None, dest: Path, group: Any, error: BaseException | None = None
) -> list[Outcome] | None:
    """Every copying rank: the visibility check (first copy into the folder), this rank's share, every rank's outcome.
    ``fd``: the temporary file, None where it could not be opened (``error`` says why). None when some rank does not
    see the folder (``fd`` closed, rank 0's file removed). ``fd`` is closed on return except on rank 0 when every rank
    copied its share."""
    rank, ranks = dist.get_rank(), dist.get_world_size(group)
    temp = Path(plan.temp)
    if plan.token is not None:
        seen = agree_seen(dest, fd, plan.token, temp, group)
        _seen[os.path.abspath(dest.parent)] = seen
        if not seen:
            return None
    try:
        if fd is None:
            raise write_error(dest, error or FileNotFoundError(plan.temp))
        mine = Outcome(value=_write_share(plan, fd, dest, byte_ranges(plan.size, ranks)[rank]))
    except Exception as err:  # relayed to rank 0 by the gather
        mine = Outcome.failed(rank, err)
    try:
        with collective_step(f"gathering every rank's share of the copy into {str(dest)!r}", CheckpointWriteError):
            outcomes: list[Outcome] = all_gather_objects(mine, group=group)
    except CheckpointWriteError:
        if fd is not None:
            os.close(fd)
        if rank == 0:
            discard_temp(temp)
        raise
    failed = any(o.error is not None for o in outcomes)
    if fd is not None and (rank != 0 or failed):
        os.close(fd)
    if rank == 0 and failed:
        discard_temp(temp)
    return outcomes


def copy_striped_share(dest: Path, group: Any) -> None:
    """On a copying rank other than rank 0: wait for rank 0's plan and copy this rank's range (see the module). Its
    error goes to rank 0 (and this rank raises only what it could not tell rank 0: a lost peer). Collective on
    ``group``, in a background thread."""
    with collective_step("receiving the snapshot's copy from rank 0", CheckpointWriteError):
        plan = broadcast_object(None, src=0, group=group)
    if not isinstance(plan, _Plan):
        return  # rank 0 has nothing to copy: its own error says why
    fd: int | None = None
    error: OSError | None = None
    try:
        fd = os.open(plan.temp, _OPEN_FLAGS)
    except OSError as err:  # the visibility check (the first copy into the folder) or the share's error says so
        error = err
    _copy(plan, fd, dest, group, error)


def copy_striped(snapshot: Snapshot, dest: Path, group: Any) -> bool:
    """On rank 0: copy ``snapshot`` into ``dest`` with its node's ranks (see the module); True once ``dest`` is
    committed, False when some rank does not see the folder (nothing written: the caller copies alone). Raises the
    copy's error (any rank's; :class:`CheckpointCorruptError` when the bytes are not the snapshot's), nothing
    committed. Collective on ``group``, in a background thread."""
    key = os.path.abspath(dest.parent)
    try:
        fd, plan = _begin(snapshot, dest, key not in _seen)
    except BaseException:
        call_off(group)
        raise
    try:
        _send(plan, group)
    except BaseException:
        os.close(fd)
        discard_temp(Path(plan.temp))
        raise
    outcomes = _copy(plan, fd, dest, group)
    if outcomes is None:
        return False
    what = (
        f"could not copy their share of the snapshot of step {snapshot.step} into {str(dest)!r}: nothing was saved, "
        "the previous checkpoint (if any) is untouched"
    )
    err = first_failure(outcomes, CheckpointWriteError, what)
    if err is not None:
        raise err
    crc, total = 0, 0
    for outcome in outcomes:
        share_crc, length = outcome.value
        crc, total = crc32_combine(crc, share_crc, length), total + length
    temp = Path(plan.temp)
    try:
        try:
            check_copied(snapshot, crc, total, dest)
            os.fsync(fd)
        finally:
            os.close(fd)
        commit_file(temp, dest)
    except BaseException as err:
        discard_temp(temp)
        if isinstance(err, OSError):
            raise write_error(dest, err) from err
        raise
    return True
