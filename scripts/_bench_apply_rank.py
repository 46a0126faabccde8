"""One rank of scripts/bench_apply.py, run as a script so that it imports the dist_resume of another release.

    PYTHONPATH=<a release's tree> python scripts/_bench_apply_rank.py ACTION VARIANT FOLDER STORE RANK WORLD MIB

ACTION ``save`` writes ``FOLDER/ckpt_00000001.pt`` through that release's ``CheckpointManager``; ``resume`` builds
the model and its warm AdamW state, waits for every rank, then resumes as VARIANT says (``file``: ``resume`` of the
file on every rank; ``folder``: ``CheckpointManager.resume``; ``broadcast``: the same with ``broadcast_from_rank0``;
``fsdp2``: the folder into a ``fully_shard`` model) and prints one JSON line: the ``time.monotonic()`` window of the
call, its seconds and the RssAnon (KiB) just before it. The parent samples the memory from outside. Every module of
the package is imported before the call (:func:`_import_all`).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

WIDTH = 2048  # 16 MiB per weight: large tensors, as a real model's


def _rss_anon_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("RssAnon:"))


def _build(mib: int, variant: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    layers = max(1, mib * 2**20 // (4 * WIDTH * WIDTH))
    seq = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    model: nn.Module = seq
    if variant == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in seq:
            fully_shard(layer, mesh=mesh)
        fully_shard(seq, mesh=mesh)
    else:
        model = nn.parallel.DistributedDataParallel(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():  # one step on constant gradients: the state exists, as mid-training
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def _import_all(dr: Any) -> None:
    """Every module of the release's package, before the timed call: the call is timed as apply, not as the first
    import of the modules it reaches (0.4 imports lazily, so that ``import dist_resume`` stays torch-free; earlier
    releases imported everything with the package). The test accelerator, the testing helpers and the CLI are left."""
    for info in pkgutil.walk_packages(dr.__path__, "dist_resume."):
        if not any(part in info.name.split(".") for part in ("_sim", "testing", "cli", "__main__")):
            importlib.import_module(info.name)


def _manager(dr: Any, folder: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    if hasattr(dr, "ResumeOptions"):  # 0.3 and later: the objects registered once
        return dr.CheckpointManager(folder, model=model, optimizer=opt)
    return dr.CheckpointManager(folder)


def _resume(dr: Any, variant: str, folder: str, model: nn.Module, opt: torch.optim.Optimizer) -> Any:
    new_api = hasattr(dr, "ResumeOptions")
    broadcast = variant == "broadcast"
    if variant == "file":
        path = f"{folder}/ckpt_00000001.pt"
        return dr.resume(path, model=model, optimizer=opt)
    mgr = _manager(dr, folder, model, opt)
    try:
        if new_api:
            return mgr.resume(options=dr.ResumeOptions(broadcast_from_rank0=broadcast))
        return mgr.resume(model=model, optimizer=opt, broadcast_from_rank0=broadcast)
    finally:
        mgr.close()


def main(argv: list[str]) -> int:
    action, variant, folder, store, rank, world, mib = argv
    torch.set_num_threads(1)
    rank_i, world_i = int(rank), int(world)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store, world_i),
        rank=rank_i,
        world_size=world_i,
        timeout=timedelta(seconds=300),
    )
    import dist_resume as dr

    _import_all(dr)
    model, opt = _build(int(mib), variant)
    if action == "save":
        mgr = _manager(dr, folder, model, opt)
        if hasattr(dr, "ResumeOptions"):
            mgr.save(1)
        else:
            mgr.save(1, model=model, optimizer=opt)
        mgr.close()
        dist.destroy_process_group()
        return 0
    dist.barrier()
    before = _rss_anon_kib()
    t0 = time.monotonic()
    result = _resume(dr, variant, folder, model, opt)
    t1 = time.monotonic()
    dist.barrier()
    print(json.dumps({"window": [t0, t1], "seconds": t1 - t0, "before_kib": before, "step": result.step}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
