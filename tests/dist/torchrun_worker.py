"""A worker script for torchrun-launched tests: resume under DDP and report where everything went.

Run by tests/dist/test_ddp_resume.py through `torchrun` (one node) and two torchrun agents (two nodes).
Prints one JSON line prefixed with RESULT on every rank.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from datetime import timedelta
from unittest import mock

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import dist_resume
from tests.dist.ddp_workers import flat_state, make, train


def main() -> None:
    ckpt = sys.argv[1]
    info = dist_resume.init_distributed(timeout=timedelta(seconds=60))
    # Pretend this node has as many GPUs as processes: which device would each rank take?
    with (
        mock.patch("torch.accelerator.current_accelerator", return_value=torch.device("cuda")),
        mock.patch("torch.accelerator.device_count", return_value=info.local_world_size),
    ):
        would_use = str(dist_resume.rank_device())
        would_map = str(dist_resume.rank_map_location())
    model, _, _ = make(seed=10 + info.rank)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    loaded = dist_resume.load_checkpoint(ckpt)  # GPU-tagged file: must land on this rank's device
    devices = sorted({str(t.device) for t in loaded["model"].values()})
    result = dist_resume.resume(ckpt, model=ddp, optimizer=opt, scheduler=sched)
    dist_resume.check_devices(ddp, opt)
    state = flat_state(ddp, opt)
    checksum = torch.tensor([sum(float(v.double().sum()) for v in state.values())], dtype=torch.float64)
    gathered = [torch.zeros_like(checksum) for _ in range(info.world_size)]
    dist.all_gather(gathered, checksum)
    losses = train(ddp, opt, sched, steps=2, seed=info.rank)
    report = {
        "rank": info.rank,
        "local_rank": info.local_rank,
        "node_rank": info.node_rank,
        "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")},
        "would_use": would_use,
        "would_map": would_map,
        "loaded_devices": devices,
        "step": result.step,
        "restored": list(result.restored),
        "checksums_equal": all(torch.equal(gathered[0], g) for g in gathered),
        "checksum": float(checksum),
        "losses_finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
    }
    sys.stdout.write("RESULT " + json.dumps(report) + "\n")  # one write: lines of ranks never interleave
    sys.stdout.flush()
    dist.barrier()  # nobody tears down its connections while a peer is still talking
    del ddp, model, opt, sched  # a gloo group destroyed from DDP's destructor can hang or abort at exit
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
