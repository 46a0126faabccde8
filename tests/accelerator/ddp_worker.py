"""torchrun worker for tests/accelerator/test_sim_backend.py: DDP over simgloo, each rank on sim:LOCAL_RANK.

Each rank writes its report to ``<argv[1]>/rank<RANK>.json`` (printing could interleave the two ranks' lines). The
test imports ``make_model``, ``batch`` and ``STEPS`` to compute the
single-process reference.
"""

from __future__ import annotations

import io
import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.accelerator.worker_boot import boot

STEPS = 3
LR = 0.1


def make_model() -> torch.nn.Module:
    """The same initial weights in every process (seeded CPU initialisation)."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s inputs and targets at ``step``, on the CPU (a generator of its own: no global RNG used)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)


def main() -> None:
    device = boot()  # first: the library loads before any tensor or backward pass
    dist.init_process_group(device_id=device, timeout=timedelta(seconds=60))  # backend picked by device type
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {
        "rank": rank,
        "device": str(device),
        "backend": dist.get_backend(),
        "default_backend_for_sim": dist.Backend.default_device_backend_map.get("sim"),
    }

    model = make_model().to(device)
    ddp = DDP(model, device_ids=[device.index])
    opt = torch.optim.SGD(ddp.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = batch(step, rank)
        if step == 0:  # DDP moves a CPU batch to device_ids[0] itself
            inputs = x
        else:
            inputs = x.to(device)
        loss = torch.nn.functional.mse_loss(ddp(inputs), y.to(device))
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
    report["param_devices"] = sorted({str(p.device) for p in model.parameters()})
    other = 1 - device.index
    report["memory_own_device"] = torch.accelerator.memory_allocated(device.index)
    report["memory_other_device"] = torch.accelerator.memory_allocated(other)
    report["params"] = [p.detach().cpu().flatten().tolist() for p in model.parameters()]

    # collectives on sim tensors
    t = torch.full((3,), float(rank + 1), device=device)
    dist.all_reduce(t)
    report["all_reduce"] = t.cpu().tolist()
    out = torch.empty(world * 2, device=device)
    dist.all_gather_into_tensor(out, torch.full((2,), float(rank), device=device))
    report["all_gather_into_tensor"] = out.cpu().tolist()
    parts = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(parts, torch.full((2,), float(rank), device=device))
    report["all_gather"] = [p.cpu().tolist() for p in parts]
    rs = torch.empty(2, device=device)
    dist.reduce_scatter_tensor(rs, torch.arange(world * 2, dtype=torch.float32, device=device))
    report["reduce_scatter_tensor"] = rs.cpu().tolist()
    b = torch.full((2,), float(rank + 10), device=device)
    dist.broadcast(b, src=0)
    report["broadcast"] = b.cpu().tolist()
    p2p = torch.full((2,), float(rank), device=device)
    if rank == 0:
        dist.send(p2p + 5, dst=1)
    elif rank == 1:
        dist.recv(p2p, src=0)
    report["recv"] = p2p.cpu().tolist()
    report["results_on"] = sorted({str(x.device) for x in (t, out, rs, b, p2p, *parts)})

    # objects: a pickled sim tensor keeps its sender's tag; torch.load(map_location=...) remaps it
    objs: list[Any] = [torch.arange(3.0, device=device)] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)
    report["object_device"] = str(objs[0].device)
    report["memory_other_device_after_object"] = torch.accelerator.memory_allocated(other)
    report["object_values"] = objs[0].cpu().tolist()
    buf = io.BytesIO()
    torch.save(torch.arange(3.0, device=device), buf)
    raw: list[Any] = [buf.getvalue()] if rank == 0 else [None]
    dist.broadcast_object_list(raw, src=0)
    report["remapped_device"] = str(torch.load(io.BytesIO(raw[0]), map_location=device, weights_only=True).device)

    dist.barrier()
    dist.destroy_process_group()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
