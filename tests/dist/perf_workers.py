"""Per-rank bodies for tests/dist/test_perf_invariants_dist.py (module level so spawned children can import them)."""

from __future__ import annotations

import contextlib
import ctypes
import gc
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dist_resume
from dist_resume._checkpoint.striped import every_rank_reads
from tests.dist.ddp_workers import flat_state


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """About 1 MiB of fp32 weights: a checkpoint of ~3 MiB with its Adam state, far above any stray read."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 256))
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=gen)).square().mean().backward()
        opt.step()


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def _mapped(path: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def reads(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume three times: broadcast_from_rank0 with mmap=False and mmap=True, then every rank reading.

    Under broadcast, ranks other than 0 get a path that does not exist here: they cannot open it.
    rchar counts read() calls (gloo receives with recv(), which it does not count); with mmap=False
    the file is read through read(), so rchar sees it.
    """
    out: dict[str, Any] = {}
    dist_resume.resume  # the public names load on first use (reading their .pyc files): before the counter runs
    for phase, broadcast, mmap in (("broadcast", True, False), ("broadcast_mmap", True, True), ("each", False, False)):
        model, opt = make(seed=10 + rank)
        train(model, opt, steps=1)  # live optimizer state exists: resume must replace it, not add to it
        path = ckpt if rank == 0 or not broadcast else ckpt + ".not-on-this-rank"
        before = {k: (v, v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}
        dist.barrier()
        start = _rchar()
        with every_rank_reads() if phase == "each" else contextlib.nullcontext():  # the control: the whole file each
            dist_resume.resume(
                path,
                model=model,
                optimizer=opt,
                options=dist_resume.ResumeOptions(mmap=mmap, broadcast_from_rank0=broadcast),
            )
        rchar = _rchar() - start
        gc.collect()
        after = model.state_dict(keep_vars=True)
        out[phase] = {
            "rchar": rchar,
            "same_tensors": all(after[k] is t and t.data_ptr() == p for k, (t, p) in before.items()),
            "file_still_mapped": _mapped(ckpt),
            "state": flat_state(model, opt),
        }
        dist.barrier()
    return out


WIDTH = 2048  # 16 MiB per weight


def _big(layers: int, fsdp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``layers`` x 16 MiB of fp32 weights under DDP (or FSDP2), with warm AdamW state (as mid-training)."""
    torch.manual_seed(0)
    seq = nn.Sequential(*(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)))
    model: nn.Module
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in seq:
            fully_shard(layer, mesh=mesh)
        fully_shard(seq, mesh=mesh)
        model = seq
    else:
        model = nn.parallel.DistributedDataParallel(seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


_LIBC = ctypes.CDLL(None)
_LIBC.mallinfo2.restype = _MallInfo2


def _allocated() -> int:
    """Bytes malloc has handed out and not got back (glibc's mallinfo2: in the arenas plus mmapped chunks). Unlike
    RssAnon it does not hide an allocation that reuses pages an earlier one freed."""
    info = _LIBC.mallinfo2()
    return int(info.uordblks + info.hblkhd)


def _peak_growth(fn: Any) -> int:
    """The highest growth of allocated memory (bytes) seen while ``fn`` runs (sampled every millisecond)."""
    import threading
    import time

    gc.collect()
    start = _allocated()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _allocated())
            time.sleep(0.001)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak[0], _allocated()) - start


def _ddp_growth(folder: str, layers: int) -> dict[str, int]:
    model, opt = _big(layers, fsdp=False)
    with dist_resume.CheckpointManager(folder, model=model, optimizer=opt) as mgr:
        mgr.save(1)
    file = str(dist_resume.CheckpointManager(folder).latest())
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)  # no state yet: resume must create it, once
    out = {}
    for name, run in (
        ("file", lambda: dist_resume.resume(file, model=model, optimizer=opt)),
        ("folder", lambda: dist_resume.resume(folder, model=model, optimizer=opt)),
        ("broadcast", lambda: dist_resume.resume(folder, model=model, optimizer=opt, options=_BROADCAST)),
        ("folder_fresh_optimizer", lambda: dist_resume.resume(folder, model=model, optimizer=fresh)),
    ):
        dist.barrier()
        out[name] = _peak_growth(run)
    return out


def resume_memory(rank: int, world_size: int, folder: str, layers: int) -> dict[str, int]:
    """Peak growth of allocated memory of each resume path, into a model whose optimizer state exists already (and
    once into a fresh optimizer)."""
    out = _ddp_growth(folder, layers)
    sharded, sharded_opt = _big(layers, fsdp=True)
    dist.barrier()
    out["fsdp2"] = _peak_growth(lambda: dist_resume.resume(folder, model=sharded, optimizer=sharded_opt))
    return out


_BROADCAST = dist_resume.ResumeOptions(broadcast_from_rank0=True)
