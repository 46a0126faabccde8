#!/usr/bin/env python
"""Benchmark dist_resume's resume and save paths against the naive ones, on the CPU, in one run.

Builds a checkpoint of ``--size-gib`` (an fp32 model plus its Adam state, saved with
dist_resume.save_checkpoint), then measures, each in fresh spawned processes (2-rank jobs use
gloo and a FileStore; 1 torch thread per process, as torchrun sets it for several ranks):

1. peak anonymous memory per rank while 2 ranks resume it into their existing models, over
   the steady footprint once resumed (model + optimizer state), for dist_resume and for the
   naive ``torch.load`` + ``model.load_state_dict`` + ``optimizer.load_state_dict``; with a fresh
   optimizer (start-up) and one that already holds state; and under ``broadcast_from_rank0``.
   The parent polls ``/proc/<pid>/status`` (RssAnon) every 2 ms: RssAnon has no peak field, and
   VmHWM counts the page cache of memory-mapped files too;
2. resume wall time against reading the file's bytes from the page cache with ``readinto``;
3. bytes read from the checkpoint file by both ranks together, with and without
   ``broadcast_from_rank0`` (how: see BYTES_NOTE);
4. how long a save stalls a training loop, asynchronous against synchronous;
5. ``adapt_state_dict`` / ``strip_prefix`` on a 200k-key state dict: time, and that no tensor is copied.

Prints a table and one JSON document (``--json-out`` also writes it); deletes its files.

    python scripts/bench.py                 # 1 GiB, a few minutes on 2 cores, ~3 GiB of disk
    python scripts/bench.py --quick         # 64 MiB and 20k keys: a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _bench_* helpers, here and in spawned children

from _bench_model import make_checkpoint, spec_for
from _bench_prefix import prefix_adapt
from _bench_proc import launch
from _bench_report import BYTES_NOTE, MEMORY_NOTE, table
from _bench_resume import resume_rank, wall_times
from _bench_save import save_stall
from _bench_targets import verdicts

MIB = 2**20
# (name, how, warm optimizer, mmap, broadcast_from_rank0)
MEMORY_RUNS = [
    ("dist_resume", "dist_resume", False, True, False),
    ("naive", "naive", False, False, False),
    ("dist_resume_warm", "dist_resume", True, True, False),
    ("naive_warm", "naive", True, False, False),
    ("dist_resume_broadcast", "dist_resume", False, True, True),
]
BYTES_RUNS = [("read_each", False), ("read_broadcast", True)]


def _memory(ckpt: Path, spec: Any, file_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, how, warm, mmap, broadcast in MEMORY_RUNS:
        run = launch(resume_rank, 2, (str(ckpt), spec, how, warm, mmap, broadcast))
        ranks = []
        for rank, res in enumerate(run.results):
            seen = run.peak(rank, res["window"])
            peak = max(seen["anon_kib"], res["before"]["RssAnon"], res["after"]["RssAnon"]) * 1024
            steady = res["after"]["RssAnon"] * 1024
            ranks.append(
                {
                    "peak_anon": peak,
                    "steady_anon": steady,
                    "before_anon": res["before"]["RssAnon"] * 1024,
                    "overhead": peak - steady,
                    "overhead_pct": 100 * (peak - steady) / file_bytes,
                    "file_pages_mapped": max(0, seen["file_kib"] - res["before"]["RssFile"]) * 1024,
                    "samples": seen["samples"],
                    "seconds": res["seconds"],
                    "probe": res["probe"],
                }
            )
        out[name] = {
            "how": how,
            "warm_optimizer": warm,
            "mmap": mmap,
            "broadcast_from_rank0": broadcast,
            "ranks": ranks,
            "overhead_pct_max": max(r["overhead_pct"] for r in ranks),
        }
    return out


def _bytes_read(ckpt: Path, spec: Any, file_bytes: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, broadcast in BYTES_RUNS:
        run = launch(resume_rank, 2, (str(ckpt), spec, "dist_resume", False, False, broadcast))
        rchar = [r["rchar"] for r in run.results]
        out[name] = {
            "broadcast_from_rank0": broadcast,
            "mmap": False,
            "rchar": rchar,
            "opened": [r["opened"] for r in run.results],
            "probe": [r["probe"] for r in run.results],
            "read_bytes": [r["read_bytes"] for r in run.results],
            "total_vs_file": sum(rchar) / file_bytes,
        }
    return out


def _prefix(keys: int, numel: int, repeats: int) -> dict[str, Any]:
    run = launch(prefix_adapt, 1, (keys, numel, repeats), use_pg=True)
    res: dict[str, Any] = run.results[0]
    for entry in res.values():
        if isinstance(entry, dict) and "window" in entry:
            entry["peak_anon_over_before_kib"] = max(
                0, run.peak(0, entry.pop("window"))["anon_kib"] - entry["anon_before_kib"]
            )
    return res


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=None, help="checkpoint size (default 1.0; 1/16 with --quick)")
    parser.add_argument("--quick", action="store_true", help="small sizes and fewer repeats: a smoke run")
    parser.add_argument("--keys", type=int, default=None, help="state-dict keys for 5. (default 200000; 20000 quick)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp folder)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON document here")
    args = parser.parse_args()
    size = int((args.size_gib if args.size_gib is not None else (1 / 16 if args.quick else 1.0)) * 2**30)
    keys = args.keys or (20_000 if args.quick else 200_000)
    rounds, reps, repeats = (3, 1, 2) if args.quick else (9, 3, 3)
    spec = spec_for(size)
    folder = Path(tempfile.mkdtemp(prefix="dist_resume-bench.", dir=args.dir))
    started, load_start = time.monotonic(), os.getloadavg()[0]
    try:
        ckpt = folder / "ckpt.pt"
        built = launch(make_checkpoint, 1, (str(ckpt), spec)).results[0]
        file_bytes = built["file_bytes"]
        doc: dict[str, Any] = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "machine": {
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "kernel": platform.release(),
                "torch": __import__("torch").__version__,
                "torch_threads_per_process": 1,
                "loadavg": {"start": load_start},
            },
            "checkpoint": {**built, "spec": vars(spec)},
            "memory": _memory(ckpt, spec, file_bytes),
            "bytes_read": _bytes_read(ckpt, spec, file_bytes),
            "wall": launch(wall_times, 1, (str(ckpt), spec, rounds)).results[0],
            "save_stall": launch(save_stall, 1, (str(folder), spec, reps)).results[0],
            "prefix": _prefix(keys, 512, repeats),
            "notes": {"memory": MEMORY_NOTE, "bytes_read": BYTES_NOTE},
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    doc["seconds"] = time.monotonic() - started
    doc["machine"]["loadavg"]["end"] = os.getloadavg()[0]
    doc["targets"] = verdicts(doc)
    print(table(doc))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
