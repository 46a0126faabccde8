"""A worker script for `torchrun --nproc_per_node=1`: the script a user writes for any number of processes.

Run by tests/dist/test_single_process_group.py. init_distributed() must make a process group of one, so the
unconditional DistributedDataParallel(model) and destroy_distributed() work; prints one JSON line prefixed RESULT.
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dist_resume


def main() -> None:
    ckpt = sys.argv[1]
    info = dist_resume.init_distributed(timeout=timedelta(seconds=30))
    report: dict[str, object] = {
        "world_size": info.world_size,
        "is_distributed": info.is_distributed,
        "initialized": dist.is_initialized(),
        "group_size": dist.get_world_size() if dist.is_initialized() else None,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "device": str(dist_resume.rank_device()),
    }
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 2))  # unconditional, as scripts for N processes write it
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    dist_resume.save_checkpoint(ckpt, model=model, optimizer=opt, step=1)  # collective: rank 0 writes
    weight = model.module.weight.detach().clone()
    with torch.no_grad():
        model.module.weight.zero_()
    result = dist_resume.resume(ckpt, model=model, optimizer=opt)
    report["resumed_step"] = result.step
    report["resumed_weights"] = bool(torch.equal(model.module.weight, weight))
    report["saved_keys_unprefixed"] = not any(k.startswith("module.") for k in torch.load(ckpt)["model"])
    dist_resume.destroy_distributed()
    report["initialized_after_destroy"] = dist.is_initialized()
    dist_resume.destroy_distributed()  # a second call is a no-op
    sys.stdout.write("RESULT " + json.dumps(report) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
