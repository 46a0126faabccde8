"""Per-rank bodies for tests/dist/test_options.py (module level so spawned children can import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel

import dist_resume
from tests.dist.ddp_workers import Net, flat_state, make


def broadcast_with_ema_and_allowed_missing(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume a file without scheduler state into a DDP model, its optimizer, a scheduler and an EMA of the
    DDP model, with only rank 0 reading the file."""
    model, opt, sched = make(seed=40 + rank)
    ddp = DDP(model)
    torch.manual_seed(90 + rank)
    ema = AveragedModel(ddp)  # keys module.module.* + n_averaged
    before_sched = sched.state_dict()
    path = ckpt if rank == 0 else ckpt + ".not-on-this-rank"
    result = dist_resume.resume(
        path,
        model=ddp,
        optimizer=opt,
        scheduler=sched,
        ema=ema,
        options=dist_resume.ResumeOptions(allow_missing=("scheduler",), broadcast_from_rank0=True),
    )
    inner = ema.module.module
    assert isinstance(inner, Net)
    return {
        "restored": result.restored,
        "skipped": result.skipped,
        "applied": result.applied,
        "scheduler_unchanged": sched.state_dict() == before_sched,
        "state": flat_state(ddp, opt),
        "ema": {k: v.detach().clone() for k, v in inner.state_dict().items()},
        "n_averaged": int(ema.n_averaged),
    }
