#!/usr/bin/env python
"""Striped DDP save against the rank-0 save, side by side (issue 38; the save half).

Runs itself under ``torchrun --standalone`` at 2 and 4 CPU ranks with gloo. Each rank builds the same DDP model (about
128 MiB of fp32 weights, scripts/_bench_model.py) with AdamW state (a 384 MiB file) and, in interleaved rounds, saves it
with ``dist_resume.save_checkpoint`` striped (every rank writes its share) and rank-0 only (the private switch
``dist_resume._save.striped_plan.rank0_only``), on the local disk and under a simulated per-node link. Rank 0 prints,
per configuration, the median wall time of a save (barrier to return, on rank 0, which returns last: it commits) and the
bytes each rank wrote (``wchar`` of /proc/self/io, measured around the save), then the ratio rank-0 / striped.

The same run measures the memory tier's copy into the folder (``--persist``, on by default): ``snapshot(step)`` into
a directory of ``/dev/shm`` made for the run, then ``save(step)``, whose copy of the snapshot runs in background
threads, striped over the node's ranks (each copies its byte range of the snapshot file) or by rank 0 alone (the same
switch); its time is rank 0's, barrier to the copy durable (``save`` returns at once; the copy's thread joined: the
file renamed, the snapshot marked copied, a rotation that deletes nothing), and the bytes each rank's ``wchar`` around
``save`` and the join of its own copy thread.

The simulated link: every byte a save writes passes through a token bucket of ``--link-mib-s`` MiB/s per rank (the
rank's client link to shared storage, as a node's is). The benchmark alone wraps the places a save's bytes leave
Python, the rank-0 save's file object (``_format/atomic.py: _RecordingFile.write``, which ``torch.save`` and the
rank-0 copy of a snapshot write through) and the positional writes of the striped save and the striped copy
(``_format/striped_write.py: write_all``, ``_manager/snapshots/striped_copy.py: write_all``): each write happens, then
the rank sleeps until its bytes so far, at the link's rate, would have taken that long since the save began.

    python scripts/bench_striped.py                      # a few minutes on 2 cores
    python scripts/bench_striped.py --rounds 5 --ranks 2 4 --link-mib-s 256
    python scripts/bench_striped.py --ranks 2 --no-persist   # the saves alone

The resume half (striped resume against every-rank / broadcast) joins :func:`save_rows`' rows in the same table.
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
from collections.abc import Callable, Sequence
from typing import Any

WORKER_ENV = "BENCH_STRIPED_WORKER"
SHM_ENV = "DIST_RESUME_SHM_DIR"  # dist_resume._shm.SHM_DIR_ENV (the parent does not import torch)
MiB = 1 << 20


def _written() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


class Throttle:
    """A token bucket per process: :meth:`take` sleeps until ``bytes / rate`` has passed since :meth:`begin`."""

    def __init__(self) -> None:
        self.rate: float | None = None  # bytes per second; None: no link
        self._start, self._bytes = 0.0, 0

    def begin(self, rate: float | None) -> None:
        self.rate, self._start, self._bytes = rate, time.perf_counter(), 0

    def take(self, n: int) -> None:
        if self.rate is None:
            return
        self._bytes += n
        wait = self._start + self._bytes / self.rate - time.perf_counter()
        if wait > 0:
            time.sleep(wait)


def _install_throttle(throttle: Throttle) -> None:
    """Wrap the rank-0 save's file writes and the striped save's and copy's positional writes (benchmark only)."""
    from dist_resume._format import atomic, striped_write
    from dist_resume._manager.snapshots import striped_copy

    file_write = atomic._RecordingFile.write

    def throttled_file_write(self: Any, data: Any) -> int:
        n = file_write(self, data)
        throttle.take(n)
        return n

    atomic._RecordingFile.write = throttled_file_write  # type: ignore[method-assign]
    real_write_all = striped_write.write_all  # type: ignore[attr-defined]

    def throttled_write_all(fd: int, data: Any, offset: int) -> None:
        real_write_all(fd, data, offset)
        throttle.take(len(memoryview(data)))

    striped_write.write_all = throttled_write_all  # type: ignore[attr-defined]
    striped_copy.write_all = throttled_write_all  # type: ignore[attr-defined]


def _rows(
    samples: dict[tuple[str, str], list[tuple[float, int]]], kind: str, size: int, links: Sequence[str]
) -> list[dict[str, Any]]:
    """Collective: every rank's samples gathered; rank 0's median time and each rank's median bytes, per row."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, samples)
    rows = []
    for link in links:
        for mode in ("striped", "rank 0"):
            per_rank = [g[(link, mode)] for g in gathered]
            rows.append(
                {
                    "ranks": dist.get_world_size(),
                    "what": f"{kind}, {mode}",
                    "link": link,
                    "seconds": statistics.median(s for s, _ in per_rank[0]),
                    "mib_per_rank": [statistics.median(b for _, b in samples_) / MiB for samples_ in per_rank],
                    "file_mib": size / MiB,
                }
            )
    return rows


def persist_rows(
    folder: str, model: Any, opt: Any, rounds: int, links: Sequence[tuple[str, float | None]], throttle: Throttle
) -> list[dict[str, Any]]:
    """Collective (every rank): ``snapshot(step)`` then ``save(step)``, its copy into the folder striped and by rank 0
    alone in interleaved rounds, each timed from a barrier to the copy durable and marked on rank 0."""
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._save import striped_plan

    samples: dict[tuple[str, str], list[tuple[float, int]]] = {
        (link, mode): [] for link, _ in links for mode in ("striped", "rank 0")
    }
    step = 0
    # rotation deletes nothing (keep_last): the older checkpoints are removed between samples, untimed (deleting a
    # 384 MiB file takes 0.27 s here, in either mode)
    with dr.CheckpointManager(os.path.join(folder, "persist"), model=model, optimizer=opt, keep_last=99) as mgr:
        for round_ in range(rounds + 1):  # round 0 warms up (the copies' group made, the first file written): untimed
            for link, rate in links:
                for mode in ("striped", "rank 0"):
                    striped_plan.rank0_only = mode == "rank 0"
                    step += 1
                    if dist.get_rank() == 0:
                        for old in mgr.checkpoints():
                            os.unlink(old)
                    mgr.snapshot(step)
                    mgr._memory._join_commit(raising=True)  # the copy starts once the commit ends: not timed here
                    dist.barrier()
                    throttle.begin(rate)
                    before, start = _written(), time.perf_counter()
                    mgr.save(step)
                    mgr._memory._join_copy()  # rank 0: the file is durable and renamed; another rank: its share
                    if round_:
                        samples[(link, mode)].append((time.perf_counter() - start, _written() - before))
                    dist.barrier()  # rank 0's copy committed (another rank's join returns after its share)
        striped_plan.rank0_only = False
        size = os.path.getsize(mgr.checkpoints()[-1])
    return _rows(samples, "persist", size, [link for link, _ in links])


def save_rows(folder: str, rounds: int, link_mib_s: float, *, persist: bool = True) -> list[dict[str, Any]]:
    """Collective (every rank): time the striped and the rank-0 save in interleaved rounds, locally and over the
    simulated link (and with ``persist`` the memory tier's copy, :func:`persist_rows`); rows (rank 0's: with every
    rank's bytes) for :func:`print_table`."""
    import torch
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._save import striped_plan

    sys.path.insert(0, os.path.dirname(__file__))
    from _bench_model import build_model, give_adam_state, spec_for

    spec = spec_for(384 * MiB)  # ~128 MiB of weights, + AdamW's exp_avg and exp_avg_sq
    model = torch.nn.parallel.DistributedDataParallel(build_model(spec, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    give_adam_state(model, opt)
    throttle = Throttle()
    _install_throttle(throttle)
    links: list[tuple[str, float | None]] = [("local disk", None), (f"link {link_mib_s:g} MiB/s", link_mib_s * MiB)]
    modes = ["striped", "rank 0"]
    samples: dict[tuple[str, str], list[tuple[float, int]]] = {(link, mode): [] for link, _ in links for mode in modes}
    path = os.path.join(folder, "ckpt.pt")
    for _ in range(rounds):
        for link, rate in links:
            for mode in modes:
                striped_plan.rank0_only = mode == "rank 0"
                dist.barrier()
                throttle.begin(rate)
                before, start = _written(), time.perf_counter()
                dr.save_checkpoint(path, model=model, optimizer=opt, step=1, rng=False)
                samples[(link, mode)].append((time.perf_counter() - start, _written() - before))
    striped_plan.rank0_only = False
    rows = _rows(samples, "save", os.path.getsize(path), [link for link, _ in links])
    if persist:
        rows += persist_rows(folder, model, opt, rounds, links, throttle)
    return rows


def print_table(rows: Sequence[dict[str, Any]], out: Callable[[str], None] = print) -> None:
    """The rows side by side, and per (ranks, link, save or persist) the ratio of the rank-0 time to the striped."""
    out(f"{'ranks':>5}  {'link':<18} {'what':<18} {'wall s':>7}  MiB written per rank")
    for r in rows:
        written = ", ".join(f"{m:.1f}" for m in r["mib_per_rank"])
        out(f"{r['ranks']:>5}  {r['link']:<18} {r['what']:<18} {r['seconds']:>7.2f}  [{written}]")
    by = {(r["ranks"], r["link"], r["what"]): r for r in rows}
    for (ranks, link, what), r in by.items():
        kind, _, mode = what.partition(", ")
        if mode == "striped" and (ranks, link, f"{kind}, rank 0") in by:
            rank0 = by[(ranks, link, f"{kind}, rank 0")]
            out(
                f"{ranks} ranks, {link}: rank-0 {kind} / striped {kind} = {rank0['seconds'] / r['seconds']:.2f}x "
                f"(file {r['file_mib']:.0f} MiB; most any rank wrote: rank 0 {max(rank0['mib_per_rank']):.0f} MiB, "
                f"striped {max(r['mib_per_rank']):.0f} MiB)"
            )


def _worker(folder: str, rounds: int, link_mib_s: float, report: str, persist: bool) -> None:
    import torch.distributed as dist

    import dist_resume as dr

    dr.init_distributed()
    dr.set_verbosity("warning")  # no line per save
    rows = save_rows(folder, rounds, link_mib_s, persist=persist)
    if dist.get_rank() == 0:
        with open(report, "w") as f:
            json.dump(rows, f)
    dr.destroy_distributed()


def main() -> None:
    if os.environ.get(WORKER_ENV):
        _worker(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4], sys.argv[5] == "1")
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--link-mib-s", type=float, default=256.0, help="the simulated per-rank link, MiB/s")
    p.add_argument(
        "--no-persist", dest="persist", action="store_false", help="leave out the memory tier's copy into the folder"
    )
    args = p.parse_args()
    rows: list[dict[str, Any]] = []
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # the snapshots: a directory of it made for the run
    for n in args.ranks:
        with (
            tempfile.TemporaryDirectory(prefix="bench_striped.") as tmp,
            tempfile.TemporaryDirectory(prefix="bench_striped.", dir=shm) as snapshots,
        ):
            env = {**os.environ, WORKER_ENV: "1", "OMP_NUM_THREADS": "1", SHM_ENV: snapshots}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            report = os.path.join(tmp, "rows.json")
            argv = [__file__, tmp, str(args.rounds), str(args.link_mib_s), report, "1" if args.persist else "0"]
            subprocess.run([*cmd, *argv], env=env, check=True)
            with open(report) as f:
                rows += json.load(f)
    print_table(rows)


if __name__ == "__main__":
    main()
