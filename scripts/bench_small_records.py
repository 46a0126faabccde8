#!/usr/bin/env python
"""What the CRC-32 check of every small record (data.pkl, version, ...) costs on an ordinary load.

Builds two checkpoints with ``dist_resume.save_checkpoint`` (a ~100 MB model of a few large
tensors, and a model of 200,000 small parameters), then times, with the page cache warm and the
best of ``--repeat`` runs, what the check adds to every load (``check_small_records``: reading and
CRC-checking every record but the tensor data, on a zip directory already read), the directory check
``load_checkpoint`` made before (``read_records``), and ``load_checkpoint`` itself (mmap, best of a
third as many runs); the ratio is that load over the same load without the check.
Prints one line per checkpoint and a JSON document; deletes its files.

    python scripts/bench_small_records.py            # a few minutes on 2 busy cores, ~160 MB of disk
    python scripts/bench_small_records.py --repeat 3
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import dist_resume
from dist_resume._format.records import read_records
from dist_resume._format.small_records import check_small_records


def _best(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """The best time of each function over ``repeat`` interleaved rounds (shared cores make single runs noisy)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def _model(kind: str) -> torch.nn.Module:
    if kind == "100MB":
        return torch.nn.Sequential(*(torch.nn.Linear(2500, 2500) for _ in range(4)))  # 25M fp32 parameters
    params = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(2)) for _ in range(200_000))
    module = torch.nn.Module()
    module.p = params
    return module


def measure(folder: Path, kind: str, repeat: int) -> dict[str, Any]:
    path = dist_resume.save_checkpoint(folder / f"{kind.replace(' ', '_')}.pt", model=_model(kind), step=1)
    archive_name, records = read_records(path)
    small = sum(r.file_size for r in records if "/data/" not in r.name)
    # what the check adds to every load: the small records' CRC-32, on a directory already read
    added = _best({"check": lambda: check_small_records(path, archive_name, records)}, repeat)["check"]
    directory = _best({"directory": lambda: read_records(path)}, max(1, repeat // 3))["directory"]
    load = _best({"load": lambda: dist_resume.load_checkpoint(path, map_location="cpu")}, max(1, repeat // 3))["load"]
    return {
        "checkpoint": kind,
        "file_bytes": path.stat().st_size,
        "records": len(records),
        "small_record_bytes": small,
        "directory_check_s": round(directory, 4),
        "added_s": round(added, 5),
        "load_checkpoint_s": round(load, 4),
        "ratio": round(load / (load - added), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        results = [measure(Path(tmp), kind, args.repeat) for kind in ("100MB", "200k keys")]
    for r in results:
        print(
            f"{r['checkpoint']:>10}: {r['file_bytes'] / 1e6:6.1f} MB file, {r['records']} records, "
            f"{r['small_record_bytes'] / 1e6:.2f} MB small; the check adds {r['added_s'] * 1e3:.2f} ms to a "
            f"{r['load_checkpoint_s'] * 1e3:.0f} ms load_checkpoint (x{r['ratio']})"
        )
    print(json.dumps({"torch": str(torch.__version__), "results": results}, indent=2))


if __name__ == "__main__":
    main()
