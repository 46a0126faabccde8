"""Process body for scripts/bench.py: how long a save stalls a training loop, synchronous vs asynchronous."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _bench_model import ModelSpec, build_model, give_adam_state

import dist_resume

__all__ = ["save_stall"]


def _training_step(model: torch.nn.Module, step_seconds: float) -> Callable[[], None]:
    """A stand-in training step of about ``step_seconds``: matmuls, then an in-place update of live state."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    bias = next(p for name, p in model.named_parameters() if name.endswith("bias"))
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < 0.2:
        torch.mm(a, b)
        n += 1
    repeat = max(1, round(step_seconds * n / (time.perf_counter() - start)))

    def step() -> None:
        for _ in range(repeat):
            torch.mm(a, b)
        with torch.no_grad():
            bias.add_(1e-6)  # training changes the state right after the save returns

    return step


def _timed_steps(step: Callable[[], None], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        step()
        out.append(time.perf_counter() - start)
    return out


def _one_save(step: Callable[[], None], save: Callable[[], Any], asynchronous: bool) -> dict[str, float]:
    """Steps right before (the reference), the save call, then steps until the background write is done.

    stall = the call (the loop cannot step) + the extra time of the steps that ran while the write
    went on in the background (GIL, cores and memory bandwidth shared with the writer thread).
    """
    os.sync()  # no dirty pages from the previous save slow this one down
    base = statistics.median(_timed_steps(step, 40))
    start = time.perf_counter()
    handle = save()
    call = time.perf_counter() - start
    during: list[float] = []
    if asynchronous:
        while not handle.done():
            during += _timed_steps(step, 1)
        handle.wait()
    interference = sum(during) - len(during) * base
    return {
        "call": call,
        "interference": interference,
        "stall": call + interference,
        "steps_during": len(during),
        "base_step": base,
        "write": time.perf_counter() - start,
    }


def save_stall(
    rank: int, world_size: int, folder: str, spec: ModelSpec, reps: int, step_seconds: float = 0.005
) -> dict[str, Any]:
    """Interleaved synchronous and asynchronous saves of the same model + Adam state from a training loop."""
    model = build_model(spec, seed=7)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    give_adam_state(model, opt)
    step = _training_step(model, step_seconds)
    runs: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for rep in range(reps):
        for kind in ("sync", "async"):
            path = Path(folder) / f"{kind}-{rep}.pt"
            fn = dist_resume.save_checkpoint_async if kind == "async" else dist_resume.save_checkpoint

            def save(fn: Any = fn, path: Path = path, rep: int = rep) -> Any:
                return fn(path, model=model, optimizer=opt, step=rep, rng=False)

            runs[kind].append(_one_save(step, save, kind == "async"))
            path.unlink(missing_ok=True)
    med = {kind: {f: statistics.median(r[f] for r in rs) for f in rs[0]} for kind, rs in runs.items()}
    return {
        "reps": reps,
        "runs": runs,
        "median": med,
        "ratio": med["async"]["stall"] / med["sync"]["stall"],
        "call_ratio": med["async"]["call"] / med["sync"]["call"],
    }
