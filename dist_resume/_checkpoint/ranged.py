"""A resume from a checkpoint on an object store: validate on stand-ins, read what the steps need, apply, and read the
rest at the commit straight from the store into the live tensors.

Each rank reads the object's structure (:func:`~dist_resume._source.read.read_source` with ``ranged``; a few requests,
no tensor data) and plans on it; the tensors apply's steps use (small states, a module whose own load can raise) are
read into fresh memory, and the model's, EMA's and optimizer state's data only at the commit, after the steps (and,
when collective, every rank) succeeded, by ranges into the live tensors: no rank holds a copy of the checkpoint, only
one window of its bytes (:mod:`~dist_resume._format.ranged`). The same shape as a broadcast resume
(:mod:`.received`), with the store where rank 0 was.
"""

from __future__ import annotations

from typing import Any

import torch

from .._core.errors import CheckpointError
from .._core.tree import map_tensors
from .._dist.agree import agree_across_ranks
from .._format.ranged import RangedArchive
from .apply.transaction import Agree
from .plan.restore_plan import RestorePlan
from .received import NOTHING

__all__ = ["read_early", "apply_ranged"]


def _stand_ins(plan: RestorePlan, archive: RangedArchive) -> list[torch.Tensor]:
    """The archive's stand-ins the plan can reach: its parts but the saved model, optimizer and EMA (the plan holds
    those re-keyed, and only what it restores), and what it restores of them."""
    parts = plan.parts
    roots: list[Any] = [parts.scaler, parts.scheduler, parts.sampler, parts.rng, parts.extra]
    roots += [plan.model_state, plan.optimizer_state, plan.ema_state]
    found: dict[int, torch.Tensor] = {}
    map_tensors(roots, lambda t: found.setdefault(id(t), t) if archive.holds(t) else t)
    return list(found.values())


def read_early(archive: RangedArchive | None, plan: RestorePlan, agree: Agree | None) -> RestorePlan:
    """``plan`` (built on ``archive``'s stand-ins) pointed at fresh tensors holding what apply's steps need, read here
    (nothing for a plan built on data already read: ``archive`` None). Local, or collective with ``agree``: every rank
    learns whether every rank read it, before anything changed (:class:`CheckpointError` on every rank if not)."""
    error: CheckpointError | None = None
    arrived: dict[int, torch.Tensor] = {}
    if archive is not None:
        late = {id(t) for t in plan.late_tensors()}
        early = [t for t in _stand_ins(plan, archive) if id(t) not in late]
        try:
            arrived = archive.read_fresh(early)
        except Exception as err:
            archive.close()
            error = CheckpointError(
                f"{archive.path}: reading the checkpoint's small states failed ({type(err).__name__}: {err}) before "
                "anything changed, so nothing was restored; resume again"
            )
            error.__cause__ = err
    if agree is not None:
        agree_across_ranks(error, what=NOTHING, fallback=CheckpointError)
    if error is not None:
        raise error
    return plan.rebind(arrived)


def apply_ranged(archive: RangedArchive, plan: RestorePlan, agree: Agree | None) -> tuple[str, ...]:
    """Apply ``plan`` (built on ``archive``'s stand-ins): what the steps need read first (:func:`read_early`), the rest
    read at the commit into the live tensors. Local, or collective with ``agree`` (every rank learns whether every rank
    read what its steps need, then apply agrees as usual). Returns the parts restored."""
    return read_early(archive, plan, agree).apply(agree=agree, transfer=archive.transfer)
