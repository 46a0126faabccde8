"""The rank body of scripts/bench_exact_costs.py (module level, so that the spawned ranks can import it)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

import dist_resume as dr


def resume_rank(rank: int, world: int, folder: str, rounds: int) -> dict[str, float]:
    """Per rank: median seconds of ``resume`` into a new DDP, with the saved layout and without it."""
    import resource

    from torch.nn.parallel import DistributedDataParallel as DDP

    def model() -> DDP:
        torch.manual_seed(0)
        return DDP(torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(16)]), bucket_cap_mb=1)

    ddp = model()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 256)).sum().backward()
        opt.step()
    with_layout = Path(folder) / "with.pt"
    dr.save_checkpoint(with_layout, model=ddp, optimizer=opt, step=3)
    without = Path(folder) / "without.pt"
    if rank == 0:
        obj = torch.load(with_layout, weights_only=True)
        obj["meta"].pop("ddp_buckets")
        torch.save(obj, without)
    torch.distributed.barrier()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out: dict[str, float] = {}
    for name, path in (("replayed", with_layout), ("not", without)):
        times = []
        for _ in range(rounds):
            target = model()
            target_opt = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
            torch.distributed.barrier()
            start = time.perf_counter()
            dr.resume(path, model=target, optimizer=target_opt)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times)
    out["rss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) / 1024
    return out
