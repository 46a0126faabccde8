"""Rank functions for tests/dist/test_typed_outcomes.py (module level, so forkserver children import them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import dist_resume as dr
from dist_resume._dist.comm import run_on_rank0
from dist_resume._source.consensus import resolve_checkpoint


def small_model() -> nn.Sequential:
    """The model rank 0 and the checkpoint have; rank 1 adds a layer to it."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3))


def _report(err: dr.DistResumeError) -> dict[str, Any]:
    """What a rank caught: class, message, the failing rank and every attribute."""
    attrs = {key: repr(value) if callable(value) else value for key, value in vars(err).items()}
    return {"cls": type(err).__name__, "message": str(err), "rank": err.rank, "attrs": attrs}


def _unpicklable_usage_error() -> None:
    err = dr.errors.UsageError("rank 0 cannot convert this checkpoint", "pass another destination")
    err.callback = lambda: None  # type: ignore[attr-defined]  # a lambda does not pickle
    raise err


def typed_outcomes(rank: int, world_size: int, base: str) -> dict[str, Any]:
    """Three failures in one launch; each ends in a completed collective, so the group stays usable."""
    root = Path(base)
    out: dict[str, Any] = {}
    model = small_model()
    if rank == 1:  # rank 1's model has an extra layer: its validation fails, rank 0's passes
        model.append(nn.ReLU())
        model.append(nn.Linear(3, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        dr.resume(root / "model.pt", model=model, options=dr.ResumeOptions(broadcast_from_rank0=True, rng=False))
    except dr.errors.KeyMismatchError as err:
        out["keys"] = _report(err)
    out["unchanged"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    try:
        resolve_checkpoint(root / "different" / f"rank{rank}")
    except dr.errors.CheckpointConsensusError as err:
        out["consensus"] = _report(err)
    try:
        run_on_rank0(_unpicklable_usage_error)
    except dr.errors.UsageError as err:
        out["unpicklable"] = _report(err)
    return out
