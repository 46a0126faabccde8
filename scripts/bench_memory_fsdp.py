#!/usr/bin/env python
"""FSDP2 snapshots in host memory (issue 37): the training loop's stall and the shared memory held, side by side.

An FSDP2 model of four square ``Linear`` layers (no bias), each ``fully_shard``-ed on a CPU mesh (gloo), with its AdamW
state: ``--size-mib`` in all (512 by default), so each of the 2 ranks holds half of it. Medians of ``--rounds``
interleaved rounds after two that make the slots' files (shown apart), each call timed from a barrier to its return
on every rank, the slowest rank counted:

- ``snapshot(step)`` (every rank copies its own shards into its own part of the node's shared memory) against a plain
  copy of the same bytes, each rank its own shards into a preallocated, pre-touched buffer (the limit);
- a synchronous ``save(step)`` (the sharded checkpoint folder through DCP) and the return of ``save_async(step)``;
- ``save(step)`` right after ``snapshot(step)``: it writes the sharded folder from the snapshots in a background thread
  on every rank (no copy from the device), and the time until that write is done.

Then the shared memory the node holds (``dist_resume._shm.held_bytes``: both slots of every rank's part) over the
state's size, and what ``close()`` leaves. Snapshots go into a directory of ``/dev/shm`` made for the run, the folders
into a temporary directory on the local disk; both are removed at the end.

    python scripts/bench_memory_fsdp.py                     # 512 MiB, 5 rounds: about 2 minutes on 2 busy cores
    python scripts/bench_memory_fsdp.py --size-mib 128 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OPS = ("plain copy", "snapshot", "save", "save_async", "save after snapshot", "its write in the background")


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import dist_resume as dr
    from dist_resume._save.async_save import wait_pending
    from dist_resume._shm import held_bytes

    dr.set_verbosity("warning")
    torch.set_num_threads(1)
    width = int(math.sqrt(cfg["size_mib"] * 2**20 / 4 / 3 / 4))  # 4 layers, fp32, weights + two Adam moments
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(4)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    mine = [p.to_local() for p in model.parameters()]  # type: ignore[attr-defined]  # DTensor parameters
    mine += [t.to_local() for s in opt.state.values() for t in s.values() if t.dim() > 0]
    own_bytes = sum(t.numel() * t.element_size() for t in mine)
    buffer = torch.ones(own_bytes, dtype=torch.uint8)
    snap = dr.CheckpointManager(os.path.join(cfg["dir"], "snap"), model=model, optimizer=opt, keep_last=1)
    saver = dr.CheckpointManager(os.path.join(cfg["dir"], "save"), model=model, optimizer=opt, keep_last=1)

    def plain_copy() -> None:
        offset = 0
        for t in mine:
            flat = t.detach().reshape(-1).view(torch.uint8)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()

    times: dict[str, list[float]] = {name: [] for name in OPS}

    def timed(name: str, fn: Callable[..., object], *args: object) -> object:
        dist.barrier()
        start = time.perf_counter()
        out = fn(*args)
        dist.barrier()
        times[name].append(time.perf_counter() - start)
        return out

    for round_ in range(cfg["rounds"] + 2):  # the first two: each slot's file made (measured as rounds 1 and 2)
        step = round_ + 1
        timed("plain copy", plain_copy)
        timed("snapshot", snap.snapshot, step)
        snap._memory._join_commit(raising=True)  # its CRC-32s not left running beside the next call
        timed("save after snapshot", snap.save, step)
        timed("its write in the background", wait_pending)
        timed("save", saver.save, 2 * step)
        handle: Any = timed("save_async", saver.save_async, 2 * step + 1)
        handle.wait()
    held = held_bytes(snap.folder)
    snap.close()
    saver.close()
    slowest: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(slowest, times)
    every = {n: [max(r[n][i] for r in slowest) for i in range(cfg["rounds"] + 2)] for n in OPS}
    return {
        "first_two": {n: v[:2] for n, v in every.items()},
        "rounds": {n: v[2:] for n, v in every.items()},
        "ranks": world,
        "state_bytes": own_bytes * world,
        "held_bytes_node": held,  # every rank's parts: one node here
        "held_after_close": held_bytes(snap.folder),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=float, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()

    from dist_resume.testing import run_ranks

    worker = importlib.import_module("bench_memory_fsdp")._worker  # importable by name: the ranks start it so
    shm = Path(tempfile.mkdtemp(prefix="bench_memory_fsdp.", dir="/dev/shm"))
    work = Path(tempfile.mkdtemp(prefix="bench_memory_fsdp."))
    try:
        cfg = {"size_mib": args.size_mib, "rounds": args.rounds, "dir": str(work)}
        doc = run_ranks(worker, 2, args=(cfg,), timeout=1800, env={"DIST_RESUME_SHM_DIR": str(shm)})[0]
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    median = {n: statistics.median(v) for n, v in doc["rounds"].items()}
    copy = median["plain copy"]
    print(
        f"FSDP2, {doc['ranks']} ranks, {doc['state_bytes'] / 2**20:.0f} MiB of state, median of {args.rounds} rounds:"
    )
    for name in OPS:
        print(f"  {name:<30} {median[name] * 1e3:9.1f} ms   {median[name] / copy:6.2f}x the plain copy")
    first = doc["first_two"]["snapshot"]
    print(f"  (the first two snapshots, each making its slot's file: {first[0] * 1e3:.1f} and {first[1] * 1e3:.1f} ms)")
    print(
        f"  shared memory held by the node: {doc['held_bytes_node'] / 2**20:.0f} MiB, "
        f"{doc['held_bytes_node'] / doc['state_bytes']:.2f}x the state; after close(): {doc['held_after_close']} bytes"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**doc, "median": median}, indent=1))


if __name__ == "__main__":
    main()
