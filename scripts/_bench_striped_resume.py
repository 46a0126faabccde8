#!/usr/bin/env python
"""The resume half of the striped benchmark (issue 38): striped resume against every-rank reads and broadcast_from_rank0.

:func:`resume_rows` runs inside torchrun ranks (gloo, CPU): a DDP model of ``mib`` MiB (2048x2048 Linear layers) with
AdamW state is saved once with ``CheckpointManager.save`` (whichever writer it uses), then resumed in interleaved rounds
by each mode: ``striped`` (the default), ``every rank (mmap)`` (the path before it, forced with ``every_rank_reads``:
every rank maps the whole file and copies it), ``every rank (read)`` (the same with ``mmap=False``, so its reads show in
``/proc/self/io``), and ``broadcast_from_rank0``. Per mode: the median wall time (the slowest rank's, each round) and
each rank's bytes read (``rchar``: read syscalls; mapped pages do not count there).

The simulated per-node link: each rank's reads are throttled to ``link`` bytes/s by sleeping ``bytes / link`` after
each read, in this benchmark only. The striped path's reads all go through ``dist_resume._format.local_ranges.read_at``
(wrapped); the other modes read through ``torch.load``, wrapped in ``dist_resume._source.read.load_torch_file``, which
is charged the file's size before it runs (it maps or reads every byte of it).

    python scripts/_bench_striped_resume.py                     # 2 and 4 ranks, 128 MiB, 3 rounds
    python scripts/_bench_striped_resume.py --ranks 2 --mib 32 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

WORKER_ENV = "BENCH_STRIPED_RESUME_WORKER"
MODES = ("striped", "every rank (mmap)", "every rank (read)", "broadcast_from_rank0")


def _rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@contextmanager
def _throttled(link: float | None, file_size: int) -> Iterator[None]:
    """Each read of this process charged ``bytes / link`` seconds (see the module docstring); nothing when None."""
    if link is None:
        yield
        return
    from dist_resume._format import load as load_module
    from dist_resume._format import local_ranges
    from dist_resume._source import read as read_module

    real_read, real_load = local_ranges.read_at, load_module.load_torch_file

    def read_at(f: Any, start: int, buffer: memoryview) -> int:
        n = real_read(f, start, buffer)
        time.sleep(n / link)
        return n

    def load_torch_file(*args: Any, **kwargs: Any) -> Any:
        time.sleep(file_size / link)
        return real_load(*args, **kwargs)

    vars(local_ranges)["read_at"] = read_at
    vars(read_module)["load_torch_file"] = load_torch_file
    try:
        yield
    finally:
        vars(local_ranges)["read_at"] = real_read
        vars(read_module)["load_torch_file"] = real_load


def resume_rows(folder: str, *, mib: int = 128, rounds: int = 3, link: float = 1 << 30) -> list[dict[str, Any]]:
    """Collective (every torchrun rank calls it): the table's rows, one per mode and link (``None``: the local disk;
    ``link``: bytes/s per rank), each with the median wall time and every rank's bytes read. Rank 0's rows are
    complete; the others return the same."""
    import torch
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._checkpoint.striped import every_rank_reads

    torch.manual_seed(0)
    layers = max(1, mib // 16)  # 16 MiB per 2048x2048 float32 Linear
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(layers)))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, 2048)).sum().backward()
    opt.step()
    manager = dr.CheckpointManager(folder, model=model, optimizer=opt, keep_last=1)
    path = manager.save(1)
    manager.close()
    size = os.path.getsize(path)
    runs: dict[str, Callable[[], object]] = {
        "striped": lambda: dr.resume(path, model=model, optimizer=opt),
        "every rank (mmap)": lambda: dr.resume(path, model=model, optimizer=opt),
        "every rank (read)": lambda: dr.resume(path, model=model, optimizer=opt, options=dr.ResumeOptions(mmap=False)),
        "broadcast_from_rank0": lambda: dr.resume(
            path, model=model, optimizer=opt, options=dr.ResumeOptions(broadcast_from_rank0=True)
        ),
    }
    times: dict[tuple[str, str], list[float]] = {}
    reads: dict[tuple[str, str], list[int]] = {}
    for _ in range(rounds):
        for link_name, bw in (("local disk", None), (f"{link / (1 << 30):g} GiB/s link", link)):
            for mode in MODES:
                forced = every_rank_reads() if mode.startswith("every rank") else _nothing()
                with forced, _throttled(bw, size):
                    dist.barrier()
                    before, start = _rchar(), time.perf_counter()
                    runs[mode]()
                    took, got = time.perf_counter() - start, _rchar() - before
                slowest = torch.tensor([took], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                every = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
                dist.all_gather(every, torch.tensor([got], dtype=torch.int64))
                times.setdefault((link_name, mode), []).append(float(slowest))
                reads[(link_name, mode)] = [int(t) for t in every]
    return [
        {
            "ranks": dist.get_world_size(),
            "link": link_name,
            "mode": mode,
            "file_bytes": size,
            "seconds": statistics.median(times[(link_name, mode)]),
            "read_per_rank": reads[(link_name, mode)],
        }
        for (link_name, mode) in times
    ]


@contextmanager
def _nothing() -> Iterator[None]:
    yield


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table: per world size and link, each mode's time and bytes read per rank, with the ratio
    of its time to the striped resume's."""
    striped = {(r["ranks"], r["link"]): r["seconds"] for r in rows if r["mode"] == "striped"}
    lines = [
        "| ranks | link | resume | wall s (median) | vs striped | MiB read per rank (rchar) | share of the file |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mib = ", ".join(f"{n / (1 << 20):.1f}" for n in r["read_per_rank"])
        share = max(r["read_per_rank"]) / r["file_bytes"]
        ratio = r["seconds"] / striped[(r["ranks"], r["link"])]
        lines.append(
            f"| {r['ranks']} | {r['link']} | {r['mode']} | {r['seconds']:.3f} | {ratio:.2f}x | {mib} | {share:.2f} |"
        )
    return "\n".join(lines)


def _worker(folder: str, mib: int, rounds: int, link: float, out: str) -> None:
    import torch.distributed as dist

    import dist_resume as dr

    dr.init_distributed()
    dr.set_verbosity("warning")
    rows = resume_rows(folder, mib=mib, rounds=rounds, link=link)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dr.destroy_distributed()


def main() -> None:
    if os.environ.get(WORKER_ENV):
        _worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=int, default=128, help="model size; the file holds about 3x with AdamW state")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--link-gib", type=float, default=1.0, help="the simulated per-rank link, GiB/s")
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    for n in args.ranks:
        with tempfile.TemporaryDirectory(prefix="bench_striped_resume.") as tmp:
            out = os.path.join(tmp, "rows.json")
            env = {**os.environ, WORKER_ENV: "1", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__]
            link = str(args.link_gib * (1 << 30))
            subprocess.run(
                [*cmd, os.path.join(tmp, "run"), str(args.mib), str(args.rounds), link, out], env=env, check=True
            )
            with open(out) as f:
                rows += json.load(f)
    print(table(rows), flush=True)


if __name__ == "__main__":
    main()
