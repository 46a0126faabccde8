"""Per-rank bodies for tests/dist/test_ddp_buckets.py: a DDP run resumed in the same processes (a new DDP, a new
optimizer, ``dist_resume.resume``) against the same run uninterrupted, variant by variant, in one launch."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume


def _net(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4),
    )  # fmt: skip


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)


def averaging_hook(state, bucket):  # type: ignore[no-untyped-def]
    """A user's own comm hook: the mean of the bucket, as DDP's built-in all-reduce computes it (unannotated: DDP
    checks the annotation is ``dist.GradBucket`` itself, and this module's annotations are strings)."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])


def _device() -> torch.device:
    """This rank's device: ``cuda:<rank>`` under NCCL (the multi-GPU job), else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _make(options: dict[str, Any], seed: int) -> tuple[DDP, torch.optim.Optimizer]:
    options = dict(options)
    hook = options.pop("hook", False)
    device = _device()
    ddp = DDP(_net(seed).to(device), device_ids=[device.index] if device.type == "cuda" else None, **options)
    if hook:
        ddp.register_comm_hook(None, averaging_hook)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)


def _train(ddp: DDP, opt: torch.optim.Optimizer, start: int, stop: int, rank: int) -> None:
    for step in range(start, stop):
        x, y = (t.to(_device()) for t in _batch(rank, step))
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def _state(ddp: DDP, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return [t.clone() for t in (*ddp.module.state_dict().values(), *moments)]


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def resumed_against_uninterrupted(rank: int, world_size: int, folder: str, cases: list[Any]) -> list[dict[str, Any]]:
    """For each (DDP options, resume step, forward before resume): tensors (model, momentum) that differ between the
    uninterrupted run and the run resumed at that step, 4 steps after it; the layout saved; what was logged."""
    records = _Records()
    logging.getLogger("dist_resume").addHandler(records)
    out = []
    for i, (options, at, early_forward) in enumerate(cases):
        ddp, opt = _make(options, 0)
        _train(ddp, opt, 0, at + 4, rank)
        uninterrupted = _state(ddp, opt)
        ddp, opt = _make(options, 0)
        _train(ddp, opt, 0, at, rank)
        path = os.path.join(folder, f"case{i}.pt")
        dist_resume.save_checkpoint(path, model=ddp, optimizer=opt, step=at)
        ddp, opt = _make(options, 1)
        if early_forward:  # a forward pass before the resume: DDP has started, its layout cannot be replaced
            with torch.no_grad():
                ddp(_batch(rank, 0)[0])
        records.messages.clear()
        dist_resume.resume(path, model=ddp, optimizer=opt)
        warned = [m for m in records.messages if "one bucket" in m]
        again = os.path.join(folder, f"again{i}.pt")  # saved before the resumed run's first step: the layout carries
        dist_resume.save_checkpoint(again, model=ddp, optimizer=opt, step=at)
        _train(ddp, opt, at, at + 4, rank)
        layout = torch.load(path, weights_only=True)["meta"].get("ddp_buckets")
        meta = torch.load(again, weights_only=True)["meta"]
        out.append(
            {
                "differ": _differ(uninterrupted, _state(ddp, opt)),
                "layout": layout,
                "carried": meta.get("ddp_buckets"),
                "not_replayed": meta.get("ddp_buckets_not_replayed"),  # dist-resume check's evidence
                "warned": warned,
            }
        )
    return out
