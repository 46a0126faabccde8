"""What scripts/bench_convert.py measures with: the checkpoint it converts (built in a child process), a command's
wall time and peak anonymous memory (``RssAnon`` polled every 2 ms), an fsync, a warm page cache."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path
from typing import Any

__all__ = ["BUILD", "SHAPES", "fsync", "measure", "warm"]

REPO = Path(__file__).resolve().parents[1]
# shapes cycled through to build the model: big embeddings and projections, small norms and biases
SHAPES = [(8192, 1024), (1024, 4096), (4096,), (4096, 1024), (1024,), (1024, 1024), (1024,), (256, 256), (64,)]

BUILD = r"""
import sys, torch
path, target = sys.argv[1], int(sys.argv[2])
shapes = {shapes!r}
torch.manual_seed(0)
model, state, names, total, i = {{}}, {{}}, [], 0, 0
while total < target:
    shape = shapes[i % len(shapes)]
    name = f"module.blocks.{{i // len(shapes)}}.layer{{i % len(shapes)}}.{{'weight' if len(shape) > 1 else 'bias'}}"
    p = torch.randn(shape)
    model[name] = p
    state[i] = {{"step": torch.tensor(float(i + 1)), "exp_avg": torch.randn(shape), "exp_avg_sq": torch.rand(shape)}}
    names.append(name)
    total += 3 * p.numel() * 4
    i += 1
groups = [{{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
           "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None,
           "decoupled_weight_decay": False, "params": list(range(i)), "param_names": names}}]
torch.save({{"model": model, "optimizer": {{"state": state, "param_groups": groups}}, "epoch": 3}}, path)
print(i)
"""


def _rss_anon_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def measure(cmd: list[str]) -> dict[str, Any]:
    """Run ``cmd``; its wall time, peak RssAnon (polled) and stdout."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    peak = 0
    while proc.poll() is None:
        value = _rss_anon_kib(proc.pid)
        if value is not None:
            peak = max(peak, value)
        time.sleep(0.002)
    out, err = proc.communicate()
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err}")
    return {"seconds": wall, "peak_rss_anon_mib": peak / 1024, "stdout": out}


def fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
