"""A DDP script as users write it (tests/dist/test_checkin.py runs it under torchrun with 2 ranks): no logging set up,
the manager's save moved into ``if rank == 0:`` at step ``--alone-at``, and rank 0 late to a correct save by
``--late`` seconds (a long evaluation before it)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

import dist_resume as dr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--late", type=float, default=0.0)
    p.add_argument("--alone-at", type=int, default=3)
    args = p.parse_args()

    dr.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt)
    mgr.resume()
    for step in range(1, 6):
        loss = model(torch.randn(8, 4)).square().mean()
        opt.zero_grad()
        loss.backward()  # DDP's all-reduce: a rank that skipped a collective call waits here
        opt.step()
        if step == 2:
            if rank == 0:
                time.sleep(args.late)  # an evaluation on rank 0 before the save
            mgr.save(step)
            print(f"rank {rank}: saved step {step}", flush=True)
        if step == args.alone_at and rank == 0:
            mgr.save(step)  # the drop-in edit: a collective call inside `if rank == 0:`
    mgr.close()
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
