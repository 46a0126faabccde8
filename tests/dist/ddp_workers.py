"""Per-rank bodies for tests/dist/test_ddp_resume.py (module level so spawned children can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.fc(x))))


def make(seed: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: Any,
    steps: int,
    seed: int,
    device: torch.device | str = "cpu",
) -> list[float]:
    """``steps`` steps on batches drawn from a generator of their own (made on the CPU, then moved to ``device``)."""
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen).to(device)
        y = torch.randint(0, 3, (16,), generator=gen).to(device)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


def flat_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Canonical model keys plus optimizer state keyed by parameter name, all as CPU tensors."""
    inner = dist_resume.unwrap_model(model)
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in inner.state_dict().items()}
    names = {id(p): n for n, p in inner.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[f"opt.{names[id(p)]}.{key}"] = torch.as_tensor(value).detach().cpu().clone()
    return out


def single_to_ddp(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume a single-process checkpoint into a DDP model on every rank, check, then train one DDP step."""
    model, opt, sched = make(seed=100 + rank)  # deliberately different init per rank
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    result = dist_resume.resume(ckpt, model=ddp, optimizer=opt, scheduler=sched)
    dist_resume.check_devices(ddp, opt)
    state = flat_state(ddp, opt)
    lr = opt.param_groups[0]["lr"]
    # one real DDP step: gradients are all-reduced, so parameters stay identical across ranks
    ddp.train()
    losses = train(ddp, opt, sched, steps=2, seed=1000 + rank)
    after = torch.cat([p.detach().flatten() for p in ddp.parameters()])
    gathered = [torch.zeros_like(after) for _ in range(world_size)]
    dist.all_gather(gathered, after)
    return {
        "state": state,
        "lr": lr,
        "step": result.step,
        "restored": result.restored,
        "losses": losses,
        "params_equal_across_ranks": all(torch.equal(gathered[0], g) for g in gathered),
    }


def ddp_train_and_save(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Train a DDP model a few steps, save with the collective save_checkpoint, return rank's state."""
    model, _, _ = make(seed=0)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(ddp, opt, sched, steps=3, seed=50 + rank)
    path = dist_resume.save_checkpoint(ckpt, model=ddp, optimizer=opt, scheduler=sched, step=3, epoch=0)
    exists_everywhere = os.path.getsize(path) > 0  # every rank returns only after the write
    return {"state": flat_state(ddp, opt), "lr": opt.param_groups[0]["lr"], "exists": exists_everywhere}
