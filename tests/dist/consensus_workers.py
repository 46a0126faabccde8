"""Rank functions for tests/dist/test_consensus.py (module level, so forkserver children import them)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dist_resume as dr
from dist_resume._manager.manager import CheckpointManager
from dist_resume._source.consensus import resolve_checkpoint

Outcome = tuple[Any, ...]


def filled(value: float) -> nn.Module:
    """A small model whose parameters all equal ``value``."""
    model = nn.Linear(4, 3)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _outcome(fn: Any) -> Outcome:
    """("ok", value) or ("error", class name, message, ranks) -- every rank reports, none raises."""
    try:
        return ("ok", fn())
    except dr.DistResumeError as err:
        return ("error", type(err).__name__, str(err), getattr(err, "ranks", None))


def agreement(rank: int, world_size: int, base: str) -> dict[str, Outcome]:
    """Several scenarios in one launch; each ends with a completed collective, so the group stays usable."""
    root = Path(base)
    out: dict[str, Outcome] = {}
    shared = root / "shared"
    mgr = CheckpointManager(shared, keep_last=1)
    out["save"] = _outcome(lambda: [str(mgr.save(s, model=filled(float(s)), extra={"rank": rank})) for s in (1, 2)])
    out["listing"] = ("ok", [p.name for p in mgr.checkpoints()])
    out["save_fails"] = _outcome(lambda: mgr.save(3, model=filled(3.0), extra={"bad": object()}))
    out["shared"] = _outcome(lambda: str(resolve_checkpoint(shared)))
    target = filled(-1.0)
    out["resume"] = _outcome(
        lambda: (
            dr.resume(shared, model=target, options=dr.ResumeOptions(rng=False)).step,
            bool(all(torch.all(p == 2.0) for p in target.parameters())),
        )
    )
    own = root / f"copy{rank}"  # node-local copies of the same file agree
    own.mkdir()
    shutil.copy2(shared / "ckpt_00000002.pt", own / "ckpt_00000002.pt")
    dist.barrier()
    out["copies"] = _outcome(lambda: str(resolve_checkpoint(own)))
    for scenario in ("different", "missing", "truncated", "stale", "empty", "broken"):
        out[scenario] = _outcome(lambda s=scenario: str(resolve_checkpoint(root / s / f"rank{rank}")))
    return out


def absent_rank(rank: int, world_size: int, base: str, how: str, pg_timeout: float) -> float | None:
    """Rank 0 resolves a folder; rank 1 never joins: it sleeps past the timeout, or dies at once."""
    if rank == 1:
        if how == "dies":
            import os

            os._exit(3)
        time.sleep(pg_timeout + 2)
        return None
    start = time.monotonic()
    outcome = _outcome(lambda: str(resolve_checkpoint(base)))
    elapsed = time.monotonic() - start
    (Path(base).parent / "rank0.json").write_text(json.dumps({"outcome": outcome, "elapsed": elapsed}))
    return elapsed
