"""A DDP script as users write it, for the striped save and resume across nodes (tests/dist/test_striped_two_nodes.py
runs it as two torchrun agents of 2 ranks each).

    torchrun ... tests/dist/striped_script.py DIR [--resume-from FILE] [--steps N]

A model of eight 1 MiB weights under DDP, AdamW, a ``ResumableDistributedSampler``, one ``CheckpointManager`` saving every 5
steps, no logging set up. ``--resume-from FILE`` starts from that checkpoint (``dist_resume.resume``) and first writes
what each rank then holds to ``DIR.resumed_<rank>.pt``. Each rank appends its bytes written by each save and read by
the resume (``/proc/self/io``: ``wchar``, ``rchar``) to ``DIR.io_<rank>`` (``save STEP BYTES`` / ``resume BYTES``
lines); rank 0 writes its final model and optimizer state to ``DIR.final.pt``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import dist_resume as dr


def _io(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        name, _, value = line.partition(":")
        if name == field:
            return int(value)
    raise KeyError(field)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--resume-from", type=Path, default=None)
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()

    dr.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(*(nn.Linear(512, 512) for _ in range(8))))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 512, generator=g), torch.randn(64, 512, generator=g))
    sampler = dr.ResumableDistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt, dataloader=loader, keep_last=2)
    log = Path(f"{args.folder}.io_{rank}").open("a")
    step = 0
    if args.resume_from is not None:
        before = _io("rchar")
        result = dr.resume(args.resume_from, model=model, optimizer=opt, dataloader=loader)
        print(f"resume {_io('rchar') - before}", file=log, flush=True)
        step = result.step or 0
        torch.save(
            {"model": model.module.state_dict(), "optimizer": opt.state_dict()}, f"{args.folder}.resumed_{rank}.pt"
        )
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            if step % 5 == 0:
                before = _io("wchar")
                mgr.save(step)
                print(f"save {step} {_io('wchar') - before}", file=log, flush=True)
            if step == args.steps:
                break
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict()}, f"{args.folder}.final.pt")
    mgr.close()
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
