"""Rank functions for tests/dist/test_manager_resume.py (module level, so forkserver children import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dist_resume as dr
from tests.dist.consensus_workers import filled

Outcome = tuple[Any, ...]


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _value(model: nn.Module) -> float | None:
    """The value every parameter holds, or None when they differ."""
    values = {float(v) for p in model.parameters() for v in p.detach().flatten()}
    return values.pop() if len(values) == 1 else None


def _outcome(fn: Any) -> Outcome:
    """("ok", value) or ("error", class name, message, ranks): every rank reports, none raises."""
    try:
        return ("ok", fn())
    except dr.DistResumeError as err:
        return ("error", type(err).__name__, str(err), getattr(err, "ranks", None))


def _start(
    folder: Path, value: float = -1.0, *, init_from: Path | None = None, **options: Any
) -> tuple[int | None, float | None]:
    """(the step resume returned, or None for a fresh start; the value the model then holds)."""
    model = filled(value)
    with dr.CheckpointManager(folder, model=model, optimizer=optimizer(model)) as mgr:  # its lock ends with the call
        res = mgr.resume(init_from=init_from, options=dr.ResumeOptions(**options))
    return (None if res is None else res.step), _value(model)


def scenarios(rank: int, world_size: int, base: str) -> dict[str, Outcome]:
    """Several scenarios in one launch; each ends with a completed collective, so the group stays usable."""
    root = Path(base)
    out: dict[str, Outcome] = {}
    out["first_run"] = _outcome(lambda: _start(root / "run"))
    out["init_from"] = _outcome(lambda: _start(root / "run", init_from=root / "init.pt"))
    out["init_from_broadcast"] = _outcome(
        lambda: _start(root / "run", init_from=root / "init.pt", broadcast_from_rank0=True)
    )
    mgr = dr.CheckpointManager(root / "run")
    model = filled(12.0)
    mgr.save(12, model=model, optimizer=optimizer(model))
    mgr.close()
    out["after_save"] = _outcome(lambda: _start(root / "run", init_from=root / "init.pt"))
    mine = root / "split" / f"rank{rank}"
    for scenario in ("rank1_empty", "rank1_no_folder", "rank0_empty", "init_rank1_missing"):
        init = mine / scenario / "init.pt" if scenario == "init_rank1_missing" else mine / "init.pt"
        out[scenario] = _outcome(lambda s=scenario, i=init: _start(mine / s, init_from=i))
    dist.barrier()
    return out
