"""A DDP script with two DataLoaders whose workers are alive when a preemption notice comes (tests/dist/
test_memory_workers.py runs it under torchrun with 2 ranks).

    torchrun --standalone --nproc_per_node=2 tests/dist/memory_workers_script.py DIR --preempt-at K

Each step draws a batch from a loader with persistent workers and one from a loader whose workers live for one epoch
(both ``num_workers=2``, forked by the default start method), trains, and snapshots; there is no ``save``. The second
epoch's workers of the second loader are forked after snapshots and exit at its end: they must write nothing. In the
third, after ``snapshot(K)``, every rank meets at a barrier, rank 0 prints the folder's checkpoint files (and temporary ones) and sends torchrun
SIGTERM (a preemption notice: torchrun sends SIGTERM to each worker's process group, the DataLoader workers
included), and every rank waits for it. Rank 0's handler must write the snapshot of step K into the folder whatever
the DataLoader workers and the DataLoader's SIGCHLD handler do meanwhile.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import dist_resume as dr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--preempt-at", type=int, required=True)
    args = p.parse_args()

    dr.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    model = DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g))
    persistent = DataLoader(
        data, batch_size=4, sampler=DistributedSampler(data, seed=0), num_workers=2, persistent_workers=True
    )
    per_epoch = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, seed=1), num_workers=2)
    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt)
    print(f"rank {rank}: resumed {mgr.resume()}", flush=True)
    step = 0
    for _epoch in range(3):
        for (x, y), (x2, _) in zip(persistent, per_epoch):
            loss = nn.functional.cross_entropy(model(x + 0 * x2), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            mgr.snapshot(step)
            if step == args.preempt_at:
                dist.barrier()  # every rank's snapshot of K committed
                if rank == 0:
                    files = sorted(n for n in os.listdir(args.folder) if "ckpt_" in n)
                    print(f"before the notice, at step {step} (workers alive): {files}", flush=True)
                    os.kill(os.getppid(), signal.SIGTERM)
                time.sleep(60)  # torchrun's SIGTERM ends it
    mgr.close()
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
