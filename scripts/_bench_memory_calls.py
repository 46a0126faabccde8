"""``python scripts/bench_memory.py --per-call``: what one ``snapshot(step)`` costs against a plain copy of the same
tensors, at small and large states and at 1, 2 and 4 ranks, and where its fixed cost goes (issue 44, item 4).

Each (state size, ranks) is one ``torchrun --standalone`` launch (gloo, one torch thread a rank) of the model of
scripts/bench_memory.py (four square ``Linear`` without bias and their AdamW state, ``size`` MiB in all). Every round,
each call timed on every rank from a barrier to its return (the slowest rank counted; no barrier after it, whose own
cost, over a millisecond on gloo here, would pad both sides): the plain copy (the node's local rank 0 copies every tensor
into a preallocated, pre-touched buffer, as the stall of scripts/bench_memory.py does), then ``snapshot(step)``. The
snapshot's background commit (its CRC-32s and record) is waited for outside the timing, as a training step between
two snapshots would let it end; a state up to ``COMMIT_INLINE_BYTES`` is committed inside the call. The first
``--warmup`` rounds (the slot files made) are left out; figures are medians of ``--rounds`` rounds, with the median of
each round's own ratio beside them (the machine is shared: a figure moves from round to round, a ratio less).

On rank 0 each stage of the call is timed by wrapping the function that does it (``time.perf_counter``, medians):
the check-in through the store (``check-in``), rank 0's lock taken and the folder's identity learned (``prepare``: the
first snapshot only, left out with the warm-up), every rank's RNG streams and data position
gathered (``rng``), the payload built (``build``), its file laid out (``layout``), the slot's store work and the copy
(``store`` and ``copy``), the evidence kept for ``save`` (``evidence``), the node's ranks meeting and every rank
agreeing, then the commit begun (``agree+commit``: inline for a state up to ``COMMIT_INLINE_BYTES``, else a thread
started); ``fixed`` is the call less its copy.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAGES = ("check-in", "prepare", "rng", "build", "layout", "store", "copy", "evidence", "agree+commit")


def _timed(stages: dict[str, list[float]], name: str, module: Any, attr: str, *, inside: str | None = None) -> None:
    """Wrap ``module.attr`` so that each call adds its seconds to ``stages[name]`` (less ``inside``'s, when given)."""
    real = getattr(module, attr)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        before = sum(stages[inside]) if inside else 0.0
        try:
            return real(*args, **kwargs)
        finally:
            spent = time.perf_counter() - start - ((sum(stages[inside]) - before) if inside else 0.0)
            stages[name].append(spent)

    setattr(module, attr, wrapper)


def calls_worker(cfg: dict[str, Any], build: Callable[..., Any], state_tensors: Callable[..., Any]) -> None:
    """One launch: ``cfg["rounds"]`` rounds of a plain copy and a snapshot, with rank 0's stage timings."""
    import torch
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._manager import manager
    from dist_resume._manager.snapshots import evidence, tier, writer

    dr.init_distributed()
    dr.set_verbosity("warning")
    rank = dist.get_rank()
    local_writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    model, opt, _ = build(cfg["size_mib"], with_state=True)
    tensors = state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    buffer = torch.ones(state_bytes if local_writer else 0, dtype=torch.uint8)  # pre-touched
    mgr = dr.CheckpointManager(os.path.join(cfg["dir"], "calls"), model=model, optimizer=opt, keep_last=1)
    stages: dict[str, list[float]] = {name: [] for name in STAGES}
    if rank == 0:
        _timed(stages, "prepare", tier, "run_on_rank0")
        _timed(stages, "rng", tier, "prepare_payload")
        _timed(stages, "copy", writer, "copy_records")
        _timed(stages, "layout", writer, "laid_out")
        _timed(stages, "store", writer, "begin_copy", inside="copy")
        _timed(stages, "agree+commit", tier, "agree_then_commit")
        _timed(stages, "check-in", manager, "check_in")
        _timed(stages, "evidence", evidence.Evidence, "of")
        _timed(stages, "build", tier, "begin_write")
    plain: list[float] = []
    snap: list[float] = []

    def copy_all() -> None:
        if local_writer:
            offset = 0
            for t in tensors:
                flat = t.detach().reshape(-1).view(torch.uint8)
                buffer[offset : offset + flat.numel()].copy_(flat)
                offset += flat.numel()

    for step in range(1, cfg["warmup"] + cfg["rounds"] + 1):
        dist.barrier()  # each call timed on every rank from here to its return; the slowest rank counted
        start = time.perf_counter()
        copy_all()
        plain.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        mgr.snapshot(step)
        snap.append(time.perf_counter() - start)
        if local_writer:
            mgr._memory._join_commit(raising=True)  # as a training step between two snapshots lets it end
    mgr.close()
    times = {"plain copy": plain, "snapshot": snap}
    slowest: list[dict[str, list[float]]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(slowest, times)
    if rank == 0:
        skip = cfg["warmup"]
        rounds = {k: [max(r[k][i] for r in slowest) for i in range(len(plain))][skip:] for k in times}
        # begin_write holds layout, store, copy and evidence: what is left of it is building the payload
        inner = ("layout", "store", "copy", "evidence")
        built = [b - sum(stages[s][i] for s in inner) for i, b in enumerate(stages["build"])]
        stages["build"] = built
        result = {
            "ranks": dist.get_world_size(),
            "state_bytes": state_bytes,
            "rounds": rounds,
            "stages_ms": {k: statistics.median(v[skip:]) * 1e3 for k, v in stages.items() if v[skip:]},
            "commit_inline_bytes": _inline(),
        }
        Path(cfg["out"]).write_text(json.dumps(result))
    dr.destroy_distributed()


def _inline() -> int:
    from dist_resume._manager.snapshots.commit import COMMIT_INLINE_BYTES

    return COMMIT_INLINE_BYTES


def _ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def calls_table(runs: list[dict[str, Any]]) -> str:
    """The per-call figures, one row per (state, ranks), and the stages of the call on rank 0."""
    goals = {24: 2.5, 384: 1.35}
    rows = [
        "| state | ranks | plain copy | `snapshot` | ratio (rounds' own) | goal | fixed cost (call less its copy) |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        plain, snap = run["rounds"]["plain copy"], run["rounds"]["snapshot"]
        ratio = statistics.median(snap) / statistics.median(plain)
        own = statistics.median(s / p for s, p in zip(snap, plain, strict=True))
        mib = round(run["state_bytes"] / 2**20)
        goal = goals.get(mib)
        mark = "" if goal is None else (f"≤ {goal}× ✅" if ratio <= goal else f"≤ {goal}× ❌")
        fixed = statistics.median(snap) * 1e3 - run["stages_ms"].get("copy", 0.0)
        rows.append(
            f"| {mib} MiB | {run['ranks']} | {_ms(statistics.median(plain))} | {_ms(statistics.median(snap))} | "
            f"{ratio:.2f}× ({own:.2f}×) | {mark} | {fixed:.2f} ms |"
        )
    rows += ["", "| state | ranks | " + " | ".join(STAGES) + " |", "|---|---|" + "---|" * len(STAGES)]
    for run in runs:
        cells = " | ".join(f"{run['stages_ms'].get(s, 0.0):.2f}" for s in STAGES)
        rows.append(f"| {round(run['state_bytes'] / 2**20)} MiB | {run['ranks']} | {cells} |")
    return "\n".join(rows)
