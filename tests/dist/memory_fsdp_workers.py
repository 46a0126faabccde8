"""Per-rank bodies for tests/dist/test_memory_fsdp.py: FSDP2 snapshots that fail on one rank, and snapshots left in
memory by a job at 2 ranks that a relaunch at 1 rank cannot use (a CPU mesh, gloo; ``DIST_RESUME_SHM_DIR`` set by the
test)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import dist_resume as dr
from dist_resume._manager.snapshots import shards
from dist_resume.errors import DistResumeError, UsageError
from tests.dist.fsdp_workers import _differ, _locals, _mesh, _sharded, _train
from tests.helpers import local_shard


def failing_snapshot(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Rank 1 fails while it writes its shards of step 2: both ranks raise one error, neither commits step 2, and a
    resume in a new manager restores step 1 from memory on both; then the job ends without ``close()``."""
    model, opt = _sharded(_mesh(world_size), 0)
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt)
    _train(model, opt, 1, seed=1)
    mgr.snapshot(1)
    after_one = _locals(model, opt)
    _train(model, opt, 1, seed=2)
    real = shards.own_shards  # type: ignore[attr-defined]  # the name shards imported (patched there)

    def broken(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot lay out its shards")
        return real(*args, **kwargs)

    with mock.patch.object(shards, "own_shards", broken):
        try:
            mgr.snapshot(2)
            error = None
        except DistResumeError as err:
            error = f"{type(err).__name__}: {err}"
    newest = mgr._memory.newest
    mgr._memory.leave(mgr._target())  # as a job ending without close(): the snapshots stay
    mgr.close()
    fresh, fresh_opt = _sharded(_mesh(world_size), 7)
    result = dr.CheckpointManager(folder, model=fresh, optimizer=fresh_opt).resume()
    assert result is not None
    return {
        "error": error,
        "newest": None if newest is None else newest.step,
        "resumed": (result.step, result.source),
        "differ": _differ(_locals(fresh, fresh_opt), after_one),
    }


def left_at_two(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Save step 2, snapshot steps 3 and 4, end without ``close()``: the snapshots stay in memory. Returns what a
    manager saving one full file (``full_state=True``) says to ``snapshot`` (its shards cannot become that file), and
    each rank's newest snapshot after ``save(2)``: rank 1 zeroes its shard of ``b.weight`` between ``snapshot(2)``
    and ``save(2)``, so every rank saves its live state and retires its snapshot of step 2."""
    model, opt = _sharded(_mesh(world_size), 0)
    full = dr.CheckpointManager(f"{folder}.full", model=model, optimizer=opt, full_state=True)
    try:
        full.snapshot(1)
        refused = "no error"
    except UsageError as err:
        refused = str(err)
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt)
    newest = None
    for step in (1, 2, 3, 4):
        _train(model, opt, 1, seed=step)
        mgr.snapshot(step)
        if step == 2:
            if rank == 1:
                with torch.no_grad():
                    local_shard(model.b.weight).zero_()  # this rank's state is no longer the snapshot's
            mgr.save(step)
            newest = None if mgr._memory.newest is None else mgr._memory.newest.step
    mgr._memory.leave(mgr._target())
    mgr.close()
    return {"refused": refused, "newest after save(2)": newest}


def resumed_at_one(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One rank resumes the folder the 2-rank job left: from its checkpoint of step 2, the snapshots kept."""
    model, opt = _sharded(_mesh(world_size), 0)
    result = dr.CheckpointManager(folder, model=model, optimizer=opt).resume()
    assert result is not None
    shm = Path(folder).parent / "shm"
    weight = local_shard(model.b.weight)  # one rank: the whole of it; rows 4-6 were rank 1's at 2 ranks
    return {
        "resumed": (result.step, result.source),
        "kept": sorted(p.name for p in shm.rglob("*.json")),
        "rank 1's rows zero": bool((weight[4:] == 0).all()) and not bool((weight[:4] == 0).all()),
    }


def uneven_commits(rank: int, world_size: int, folder: str) -> list[str]:
    """Snapshots of steps 1 and 2, rank 1's record of step 2 then lost (a SIGTERM in the middle of its commit): the
    write at an unplanned end takes step 1, the newest every rank holds."""
    from dist_resume._manager.snapshots.shards import own_part, persist_newest

    model, opt = _sharded(_mesh(world_size), 0)
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt)
    for step in (1, 2):
        _train(model, opt, 1, seed=step)
        mgr.snapshot(step)
    if rank == 1:
        store = mgr._memory.newest.path.parent  # type: ignore[union-attr]
        (store / f"{own_part(1)}.{mgr._memory.newest.slot}.json").unlink()  # type: ignore[union-attr,operator]
    dist.barrier()
    persist_newest(mgr._memory.folder, mgr._target(), mgr._memory.live, mgr._memory.identity, mgr._memory.exit_group)
    written = sorted(p.name for p in Path(folder).glob("ckpt_*"))
    mgr.close()
    return written
