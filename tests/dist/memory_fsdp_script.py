"""An FSDP2 script as users write it that snapshots every step into host memory and saves every 5 steps
(tests/dist/test_memory_fsdp.py runs it under torchrun with 2 ranks, kills a worker and lets torchrun restart it).

    torchrun --standalone --nproc_per_node=2 [--max-restarts=1] tests/dist/memory_fsdp_script.py DIR [--steps N]
        [--kill-rank1-at K] [--dump PREFIX]

An MLP with dropout, ``fully_shard`` per layer and whole on a CPU mesh (gloo), AdamW, StepLR, a ``DataLoader`` without
``generator=`` over a ``ResumableDistributedSampler``, all registered with one ``CheckpointManager``, no logging set
up. ``--kill-rank1-at K``: in torchrun's first generation rank 1 SIGKILLs itself right after ``snapshot(K)``. Each rank
appends the steps it runs to ``DIR.steps_<rank>``; ``--dump PREFIX`` writes each rank's own shards of the model and
optimizer state to ``PREFIX.<rank>``.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import dist_resume as dr


def _local(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value.to_local().clone() if hasattr(value, "to_local") else value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-rank1-at", type=int, default=None)
    p.add_argument("--dump", default=None)
    args = p.parse_args()

    dr.init_distributed()
    rank = dist.get_rank()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    loader = DataLoader(data, batch_size=4, sampler=dr.ResumableDistributedSampler(data, seed=0))
    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    result = mgr.resume()
    resumed = None if result is None else (result.step, result.source)
    print(f"rank {rank} generation {generation}: resumed {resumed}")
    step = result.step if result is not None and result.step is not None else 0
    log = Path(f"{args.folder}.steps_{rank}")
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            with log.open("a") as f:
                f.write(f"{generation} {step}\n")
            mgr.snapshot(step)  # every step: each rank its own shards, into host memory
            if step % 5 == 0:
                mgr.save(step)  # the folder gets a sharded checkpoint written from the snapshots
            if step == args.kill_rank1_at and rank == 1 and generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.steps:
                break
    mgr.close()  # writes the newest snapshot the folder lacks, frees the memory
    if args.dump:
        torch.save({"model": _local(model.state_dict()), "optimizer": _local(opt.state_dict())}, f"{args.dump}.{rank}")
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
