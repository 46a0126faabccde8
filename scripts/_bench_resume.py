"""Process bodies for scripts/bench.py: resuming (memory, bytes read) and resume wall time."""

from __future__ import annotations

import gc
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _bench_model import ModelSpec, build_model, give_adam_state
from _bench_proc import proc_io, proc_status_kib

import dist_resume

__all__ = ["resume_rank", "wall_times", "probe"]


def probe(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """A cheap fingerprint of the restored values (first 64 elements of every tensor) to compare runs."""
    total = 0.0
    for p in model.parameters():
        total += float(p.detach().reshape(-1)[:64].double().sum())
        for value in opt.state.get(p, {}).values():
            total += float(value.reshape(-1)[:64].double().sum())
    return total


def naive_resume(path: str, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """What most training scripts do: read the whole file into memory, then load_state_dict twice."""
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    del ckpt


def resume_rank(
    rank: int, world_size: int, path: str, spec: ModelSpec, how: str, warm: bool, mmap: bool, broadcast: bool
) -> dict[str, Any]:
    """One rank of a 2-rank gloo job resuming ``path`` into its existing model (and Adam).

    ``warm``: the optimizer already holds state (resume after a rollback, or eagerly built state);
    otherwise it is fresh, as at start-up. Under ``broadcast`` the other ranks get a path that
    does not exist, so they provably never open the file.
    """
    model = build_model(spec, seed=100 + rank)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    if warm:
        give_adam_state(model, opt, value=2e-3)
    my_path = path if rank == 0 or not broadcast else path + ".not-on-this-rank"
    gc.collect()
    dist.barrier()
    before, io0, start = proc_status_kib(), proc_io(), time.monotonic()
    if how == "dist_resume":
        dist_resume.resume(
            my_path,
            model=model,
            optimizer=opt,
            options=dist_resume.ResumeOptions(mmap=mmap, broadcast_from_rank0=broadcast),
        )
    else:
        naive_resume(path, model, opt)
    end, io1 = time.monotonic(), proc_io()
    gc.collect()
    after = proc_status_kib()
    dist.barrier()
    return {
        "window": (start, end),
        "seconds": end - start,
        "before": before,
        "after": after,
        "rchar": io1["rchar"] - io0["rchar"],
        "read_bytes": io1["read_bytes"] - io0["read_bytes"],
        "probe": probe(model, opt),
        "opened": my_path == path,
    }


def _read_into(path: str, view: memoryview) -> int:
    got = 0
    with open(path, "rb", buffering=0) as f:
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                break
            got += n
    return got


def wall_times(rank: int, world_size: int, path: str, spec: ModelSpec, rounds: int) -> dict[str, Any]:
    """Interleaved rounds, single process, warm page cache: each way of getting the file's bytes into memory.

    ``readinto`` fills a buffer allocated and touched beforehand (the model's tensors exist before
    a resume too); ``readinto_fresh`` allocates the buffer in the round, so it pays the first-touch
    page faults that a resume into a fresh optimizer pays for the optimizer state. Each operation
    is timed in wall time and in this thread's CPU time (user + system, page faults included),
    which other processes on the machine disturb far less.
    """
    size = os.path.getsize(path)
    model = build_model(spec, seed=100)
    opt_warm = torch.optim.Adam(model.parameters(), lr=1e-3)
    give_adam_state(model, opt_warm, value=2e-3)
    buf = bytearray(size)
    view = memoryview(buf)
    assert _read_into(path, view) == size  # warms the page cache and touches every page of the buffer
    names = (
        "readinto",
        "readinto_fresh",
        "resume_fresh",
        "resume_warm",
        "naive_fresh",
        "copy_into_params",
        "clone_state",
        "first_touch_state",
    )
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}

    def clock(name: str, fn: Any) -> None:
        gc.collect()
        start, cstart = time.perf_counter(), time.thread_time()
        kept = fn()  # freed after the clock stops: returning memory to the kernel is not part of the work
        wall[name].append(time.perf_counter() - start)
        cpu[name].append(time.thread_time() - cstart)
        del kept

    def fresh_buffer() -> bytearray:
        fresh = bytearray(size)
        _read_into(path, memoryview(fresh))
        return fresh

    def resume_fresh() -> None:  # a new optimizer each round; dropped (and freed) on return
        dist_resume.resume(path, model=model, optimizer=torch.optim.Adam(model.parameters(), lr=1e-3))

    def naive_fresh() -> None:
        naive_resume(path, model, torch.optim.Adam(model.parameters(), lr=1e-3))

    def big_moves() -> None:
        """resume's two big moves, alone: file -> existing parameters, file -> new optimizer-state tensors;
        and what new memory costs by itself: allocating and writing the optimizer state's bytes once."""
        mapped = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        params = dict(model.named_parameters())
        with torch.no_grad():
            clock("copy_into_params", lambda: [params[k].copy_(v) for k, v in mapped["model"].items()])
        clock("clone_state", lambda: [v.clone() for s in mapped["optimizer"]["state"].values() for v in s.values()])
        state_bytes = sum(
            v.numel() * v.element_size() for s in mapped["optimizer"]["state"].values() for v in s.values()
        )
        clock("first_touch_state", lambda: torch.empty(state_bytes, dtype=torch.uint8).fill_(1))

    for _ in range(rounds):
        clock("readinto", lambda: _read_into(path, view))
        clock("readinto_fresh", fresh_buffer)
        clock("resume_fresh", resume_fresh)
        clock("resume_warm", lambda: dist_resume.resume(path, model=model, optimizer=opt_warm))
        clock("naive_fresh", naive_fresh)
        big_moves()
    return {
        "file_bytes": size,
        "rounds": rounds,
        "wall": wall,
        "cpu": cpu,
        "median": {k: statistics.median(v) for k, v in wall.items()},
        "best": {k: min(v) for k, v in wall.items()},
        "cpu_median": {k: statistics.median(v) for k, v in cpu.items()},
    }
