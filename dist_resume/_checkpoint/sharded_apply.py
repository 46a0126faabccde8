"""Applying a validated FSDP2 restore: the steps that can fail (put back on a failure), the ranks' agreement, then
the fill of every shard in place as the commit (see :mod:`~dist_resume._checkpoint.apply.transaction`)."""

from __future__ import annotations

import copy
import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.location import Location
from .._core.log import log_rank0
from .._dist.shard_comm import scatter_full_into
from .._foreign.own_shards import fill_own_shards
from .._foreign.sharded_load import load_into_shards
from .._state.sharded import copy_full_into
from .apply.optimizer_step import optimizer_load_step
from .apply.step import Pairs, Step
from .apply.steps import small_steps
from .apply.transaction import Agree, run_transaction
from .plan.restore_plan import RestorePlan

__all__ = ["Fill", "ShardedRestore", "apply_sharded"]


class Fill(enum.Enum):
    """How the saved data reaches the shards."""

    COPY = "every rank copies its boxes out of its own mapping of the file"
    SCATTER = "rank 0 reads and sends each rank its boxes"
    DCP = "dcp.load reads each rank's boxes from the sharded folder"
    OWN = "every rank copies its own shards out of its own snapshot"


@dataclass(frozen=True)
class ShardedRestore:
    """A validated plan for an FSDP2 model: what to copy where, in the same order on every rank."""

    plan: RestorePlan
    fill: Fill
    pairs: Pairs  # (saved tensor or stand-in, destination): model, EMA, then optimizer state
    optimizer_state: dict[str, Any] | None  # loaded before the fill: its state tensors are the destinations
    optimizer_destinations: tuple[torch.Tensor, ...] = ()  # those tensors, which the load must keep as they are
    folder: Location | None = None  # DCP: the sharded folder
    dcp_keys: dict[int, str] = field(default_factory=dict)  # DCP, OWN: id(stand-in) -> the saved tensor's key
    own: Mapping[str, torch.Tensor] = field(default_factory=dict)  # OWN: key -> the saved local tensor
    weights_only: bool = True


def _fill(prepared: ShardedRestore) -> None:
    """Every destination filled with its saved data: collective for ``SCATTER`` and ``DCP`` (each completes its
    protocol on every rank before raising), local for ``COPY`` and ``OWN``."""
    if prepared.fill is Fill.SCATTER:
        scatter_full_into(prepared.pairs)
    elif prepared.fill is Fill.DCP:
        assert prepared.folder is not None
        targets = {prepared.dcp_keys[id(saved)]: dst for saved, dst in prepared.pairs}
        load_into_shards(prepared.folder, targets, weights_only=prepared.weights_only)
    elif prepared.fill is Fill.OWN:
        fill_own_shards({prepared.dcp_keys[id(saved)]: dst for saved, dst in prepared.pairs}, prepared.own)
    else:
        for full, dst in prepared.pairs:
            copy_full_into(dst, full)


def _extra_states(module: torch.nn.Module, state: Any) -> list[tuple[torch.nn.Module, Any]]:
    """``(submodule, non-tensor _extra_state entry)`` pairs of ``state``, for its ``set_extra_state``."""
    return [
        (module.get_submodule(key.rpartition(".")[0]), value)
        for key, value in state.items()
        if not isinstance(value, torch.Tensor) and key.rpartition(".")[2] == "_extra_state"
    ]


def _extra_step(plan: RestorePlan) -> Step | None:
    """Non-tensor ``_extra_state`` entries to their module's ``set_extra_state``, as ``load_state_dict`` does: a
    step (before the ranks agree), since an overridden ``set_extra_state`` can raise; undo sets the old state."""
    live = plan.objects
    entries = _extra_states(live.model, plan.model_state)
    if live.ema is not None and plan.ema_state is not None:
        entries += _extra_states(live.ema, plan.ema_state)
    if not entries:
        return None

    def save() -> list[tuple[torch.nn.Module, Any]]:
        return [(m, copy.deepcopy(m.get_extra_state())) for m, _ in entries]

    def do() -> None:
        for m, value in entries:
            m.set_extra_state(value)

    def undo(saved: list[tuple[torch.nn.Module, Any]]) -> None:
        for m, value in saved:
            m.set_extra_state(value)

    return Step("model", save, do, undo)


def apply_sharded(prepared: ShardedRestore, *, agree: Agree | None = None) -> tuple[str, ...]:
    """Change the live objects as :meth:`RestorePlan.apply` does, the model, EMA and optimizer through their shards.

    Collective (every rank, with ``agree``; ``SCATTER`` and ``DCP`` fill collectively). First the steps that can
    fail, each put back on a failure: the small states (GradScaler, scheduler, data position, RNG), the optimizer's
    ``load_state_dict`` of its destinations (its live state tensors, or new ones: their data not yet written), the
    modules' extra state; the ranks agree; then the commit fills every shard and destination in place, no copy kept
    (the memory bound). A fault there (data found damaged only as it is read, an I/O error) raises
    :class:`~dist_resume.errors.PartialRestoreError` on every rank: resuming again restores the checkpoint whole.
    """
    plan = prepared.plan
    live = plan.objects
    steps = small_steps(plan)
    if live.optimizer is not None and prepared.optimizer_state is not None:
        steps.append(optimizer_load_step(live.optimizer, prepared.optimizer_state, prepared.optimizer_destinations))
    extra = _extra_step(plan)
    if extra is not None:
        steps.append(extra)
    written = ", ".join(name for name in ("model", "ema", "optimizer") if name in plan.restore)

    def commit(_: Pairs) -> tuple[str, Exception | None]:
        try:
            _fill(prepared)
        except Exception as err:  # every rank learns it at the agreement after the commit
            return written, err
        return written, None

    restored = run_transaction(plan, steps, commit, agree=agree)
    log_rank0(
        logging.DEBUG, "%s: FSDP2 shards filled (%s, %d tensors)", plan.source, prepared.fill.name, len(prepared.pairs)
    )
    return restored
