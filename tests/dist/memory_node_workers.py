"""Per-rank body for tests/dist/test_memory_nodes.py: two ranks as two nodes (``nproc_per_node=1``), each node's
shared memory its own folder (``DIST_RESUME_SHM_DIR`` set per node here, before anything reads it)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import dist_resume as dr
from dist_resume._manager.snapshots.exit import unwatch


def _trained(seed: int) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = DistributedDataParallel(nn.Linear(4, 3))
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def wiped_rank0_node(rank: int, world_size: int, tmp: str, damaged: bool) -> dict[str, Any]:
    """Save step 1, snapshot steps 2 and 3, die (nothing more reaches the folder); rank 0's node's memory is wiped (a
    new machine, where rank 0 now runs); the relaunch resumes step 3 from the other node's memory (``damaged``: a
    byte flipped on the way, so the relaunch resumes step 1 from the folder)."""
    shm = Path(tmp) / f"shm{os.environ['GROUP_RANK']}"
    shm.mkdir(exist_ok=True)
    os.environ["DIST_RESUME_SHM_DIR"] = str(shm)
    folder = os.path.join(tmp, "run")
    model, opt = _trained(0)
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt)
    for step in (1, 2, 3):
        opt.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        mgr.snapshot(step)
        if step == 1:
            mgr.save(1)
    expected = {k: v.clone() for k, v in model.module.state_dict().items()}
    mgr._memory._join_commit(raising=True)
    unwatch(mgr._memory)  # the job dies here: nothing more is copied into the folder, the snapshots stay
    mgr._memory.used = False
    mgr.close()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(shm)
        shm.mkdir()
    dist.barrier()
    fresh, fresh_opt = _trained(7)
    again = dr.CheckpointManager(folder, model=fresh, optimizer=fresh_opt)
    send = dist.send

    def flipped(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tensor[0] ^= 1
        return send(tensor, *args, **kwargs)

    with mock.patch.object(dist, "send", flipped if damaged and rank == 1 else send):
        result = again.resume()
    assert result is not None
    restored = all(torch.equal(v, expected[k]) for k, v in fresh.module.state_dict().items()) or damaged
    fetched = sorted(p.name for p in shm.rglob("*.json"))
    again.close()
    return {
        "resumed": (result.step, result.source),
        "restored": restored,
        "fetched": fetched,
        "folder": sorted(p.name for p in Path(folder).glob("ckpt_*")),
    }
