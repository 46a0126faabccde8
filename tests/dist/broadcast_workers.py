"""Per-rank bodies for tests/dist/test_broadcast.py."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import dist_resume
from dist_resume._dist.broadcast import broadcast_loaded
from tests.dist.ddp_workers import flat_state, make


def mixed_tree(rank: int, world_size: int) -> dict[str, Any]:
    """Every dtype and shape corner, through buckets far smaller than the largest tensor."""
    torch.manual_seed(0)
    payload = {
        "big": torch.randn(1000, 7),
        "bf16": torch.randn(33, dtype=torch.bfloat16),
        "bool": torch.rand(17) > 0.5,
        "int": torch.arange(5, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "strided": torch.randn(6, 8).t(),
        "nested": [{"x": torch.ones(3)}, (torch.zeros(2, dtype=torch.uint8), "text", 7)],
        "plain": {"step": 12, "name": "run"},
    }
    got = broadcast_loaded(lambda: payload if rank == 0 else None, bucket_bytes=1000)
    return got


def resume_from_rank0(rank: int, world_size: int, folder: str, expected_path: str) -> dict[str, Any]:
    """Only rank 0 can see the checkpoint folder; rank 1 is handed a folder that does not exist."""
    model, opt, sched = make(seed=50 + rank)
    path = folder if rank == 0 else folder + "-not-on-this-node"
    result = dist_resume.resume(
        path, model=model, optimizer=opt, scheduler=sched, options=dist_resume.ResumeOptions(broadcast_from_rank0=True)
    )
    dist_resume.check_devices(model, opt)
    return {
        "state": flat_state(model, opt),
        "path": str(result.path),
        "step": result.step,
        "lr": opt.param_groups[0]["lr"],
        "expected_path": expected_path,
    }


def one_rank_cannot_validate(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Rank 1 has another architecture: every rank must raise, and rank 0 must not have applied anything."""
    model: nn.Module
    model, opt, _ = make(seed=9)
    if rank == 1:
        model = nn.Sequential(nn.Linear(6, 5))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return _refused(ckpt, model, opt, dist_resume.errors.StateMismatchError)


def file_without_data(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """The file rank 0 reads holds a meta tensor (no data) for a model entry: every rank must refuse it unchanged."""
    model, opt, _ = make(seed=9)
    return _refused(ckpt, model, opt, dist_resume.errors.DistResumeError)


def _refused(ckpt: str, model: nn.Module, opt: torch.optim.Optimizer, error: type[Exception]) -> dict[str, Any]:
    """A broadcast resume expected to raise ``error``: what it raised, and whether the model is as it was."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        dist_resume.resume(
            ckpt, model=model, optimizer=opt, options=dist_resume.ResumeOptions(broadcast_from_rank0=True)
        )
    except error as err:
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        return {"error": type(err).__name__, "message": str(err), "unchanged": unchanged, "opt_state": len(opt.state)}
    return {"error": None}


def rank0_cannot_read(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    model, opt, _ = make(seed=9)
    try:
        dist_resume.resume(
            ckpt, model=model, optimizer=opt, options=dist_resume.ResumeOptions(broadcast_from_rank0=True)
        )
    except dist_resume.errors.CheckpointError as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None}


def async_saves(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Two background saves through a manager, then one that fails on rank 0: every rank sees each outcome."""
    model, opt, _ = make(seed=0)
    manager = dist_resume.CheckpointManager(folder, keep_last=1)
    first = manager.save_async(1, model=model, optimizer=opt)
    with torch.no_grad():
        model.fc.weight.add_(1.0)
    second = manager.save_async(2, model=model, optimizer=opt)  # waits for the first (collective)
    path = second.wait()
    broken = dist_resume.save_checkpoint_async(folder + "-missing/x.pt", model=model)
    try:
        broken.wait()
        error = None
    except dist_resume.errors.CheckpointWriteError as err:
        error = str(err)
    return {"first_done": first.done(), "path": str(path), "error": error, "weight": model.fc.weight.detach().clone()}
