"""Per-rank bodies for tests/dist/test_perf_invariants_dist.py (module level so spawned children can import them)."""

from __future__ import annotations

import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dist_resume
from tests.dist.ddp_workers import flat_state


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """About 1 MiB of fp32 weights: a checkpoint of ~3 MiB with its Adam state, far above any stray read."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=gen)).square().mean().backward()
        opt.step()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def reads(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume three times: broadcast_from_rank0 with mmap=False and mmap=True, then every rank reading.

    Under broadcast, ranks other than 0 get a path that does not exist here: they cannot open it.
    rchar counts read() calls (gloo receives with recv(), which it does not count); with mmap=False
    the file is read through read(), so rchar sees it.
    """
    out: dict[str, Any] = {}
    dist_resume.resume  # the public names load on first use (reading their .pyc files): before the counter runs
    for phase, broadcast, mmap in (("broadcast", True, False), ("broadcast_mmap", True, True), ("each", False, False)):
        model, opt = make(seed=10 + rank)
        train(model, opt, steps=1)  # live optimizer state exists: resume must replace it, not add to it
        path = ckpt if rank == 0 or not broadcast else ckpt + ".not-on-this-rank"
        before = {k: (v, v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}
        dist.barrier()
        start = _rchar()
        dist_resume.resume(
            path,
            model=model,
            optimizer=opt,
            options=dist_resume.ResumeOptions(mmap=mmap, broadcast_from_rank0=broadcast),
        )
        rchar = _rchar() - start
        gc.collect()
        after = model.state_dict(keep_vars=True)
        out[phase] = {
            "rchar": rchar,
            "same_tensors": all(after[k] is t and t.data_ptr() == p for k, (t, p) in before.items()),
            "file_still_mapped": _mapped(ckpt),
            "state": flat_state(model, opt),
        }
        dist.barrier()
    return out
