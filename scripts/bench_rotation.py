#!/usr/bin/env python
"""What rotation's once-in-a-checkpoint's-life CRC-32 check costs a save, and what reading a folder of many
checkpoints costs.

1. ``CheckpointManager.save`` of a ~100 MB model into a folder with ``keep_last=2`` (median of ``--repeat`` saves):
   as it is (the new file read back whole once after its write), and with that read-back replaced by the structural
   check alone (what rotation did before 0.4); ``save_async`` too (the read-back runs in its thread: the call returns
   as fast either way; ``wait()`` includes it).
2. A folder of ``--count`` checkpoints (small files, and as many sharded folders): ``dist-resume list DIR`` in a fresh
   process (the torch-free path: every manifest, ``.metadata`` and train state checked), ``latest_checkpoint`` in a
   fresh process, once torch is imported (the newest's every CRC-32), and again in the same process (remembered by
   inode, size and modification time: nothing read).

Prints one line per figure and a JSON document; deletes its files.

    python scripts/bench_rotation.py              # about a minute on 2 busy cores, ~400 MB of disk
    python scripts/bench_rotation.py --repeat 3 --count 50
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import dist_resume as dr
from dist_resume._manager import rotation
from dist_resume._source.listing import check_numbered


def _median_save(folder: Path, model: torch.nn.Module, repeat: int, *, background: bool) -> dict[str, float]:
    returned, durable = [], []
    with dr.CheckpointManager(folder, keep_last=2) as mgr:
        for step in range(repeat):
            start = time.perf_counter()
            if background:
                handle = mgr.save_async(step, model=model)
                returned.append(time.perf_counter() - start)
                handle.wait()
            else:
                mgr.save(step, model=model)
                returned.append(time.perf_counter() - start)
            durable.append(time.perf_counter() - start)
    return {"returned": statistics.median(returned), "durable": statistics.median(durable)}


def _structure_only(path: Path, step: int) -> Exception | None:
    """Rotation's check of a new file as it was before the read-back: zip structure and metadata, no CRC pass."""
    try:
        check_numbered(path, step, verify=False)
    except Exception as err:
        return err
    return None


def measure_save(root: Path, repeat: int) -> dict[str, Any]:
    model = torch.nn.Sequential(*(torch.nn.Linear(2500, 2500) for _ in range(4)))  # 25M fp32: 100 MB
    out: dict[str, Any] = {}
    real = rotation.check_new
    for name, check in (("read back", real), ("structure only", _structure_only)):
        rotation.check_new = check  # type: ignore[assignment]  # the name rotate_out calls
        try:
            out[name] = {
                "save": _median_save(root / f"sync-{name}", model, repeat, background=False),
                "save_async": _median_save(root / f"async-{name}", model, repeat, background=True),
            }
        finally:
            rotation.check_new = real  # type: ignore[assignment]
    return out


def _fresh(code: str, *args: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, *args], check=True, capture_output=True)
    return time.perf_counter() - start


def measure_folder(root: Path, count: int) -> dict[str, Any]:
    files, folders = root / "files", root / "folders"
    with dr.CheckpointManager(files, keep_last=count) as mgr:
        for step in range(1, count + 1):
            mgr.save(step, model=torch.nn.Linear(64, 64))
    folders.mkdir()
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(8)))
    for step in range(1, count + 1):  # each as a manager's save names it: the folder's name, manifest and train state
        source = dr.save_checkpoint(root / "one.pt", model=model, step=step)
        dr.tools.convert_checkpoint(source, folders / f"ckpt_{step:08d}.dcp", format="sharded")
    latest = "import sys, time, dist_resume as dr; from pathlib import Path; p = Path(sys.argv[1]); dr.tools.inspect_checkpoint; t = time.perf_counter(); dr.tools.latest_checkpoint(p); first = time.perf_counter() - t; t = time.perf_counter(); dr.tools.latest_checkpoint(p); print(first, time.perf_counter() - t)"
    out: dict[str, Any] = {}
    for name, folder in (("files", files), ("sharded folders", folders)):
        listed = _fresh(
            "import sys; from dist_resume.cli import main; sys.exit(main(['list', sys.argv[1]]))", str(folder)
        )
        run = subprocess.run([sys.executable, "-c", latest, str(folder)], check=True, capture_output=True, text=True)
        first, again = map(float, run.stdout.split())
        out[name] = {"list (fresh process)": listed, "latest first call": first, "latest again": again}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--count", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        report = {"save": measure_save(root, args.repeat), "folder": measure_folder(root, args.count)}
    for name, figures in report["save"].items():
        for call, times in figures.items():
            print(f"{call:<11} ({name:<14}): returns {times['returned']:.3f} s, durable {times['durable']:.3f} s")
    for name, figures in report["folder"].items():
        print(f"{args.count} {name}: " + ", ".join(f"{k} {v:.3f} s" for k, v in figures.items()))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
