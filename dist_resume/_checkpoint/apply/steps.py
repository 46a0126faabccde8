"""The steps of apply that can fail, in order, each able to put back what it changed: the small states (GradScaler,
scheduler, data position, RNG streams), the optimizer's load (:mod:`.optimizer_step`), and the load of a module whose
own load can raise (:mod:`.module_step`); and which saved tensors only the commit needs.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..._exact import rng as _rng
from ..._exact.sampler import ResumableDistributedSampler
from .module_step import can_raise, module_pairs, module_step
from .optimizer_step import optimizer_step, saved_state
from .step import RestorePlan, Step

__all__ = ["small_steps", "committed_modules", "steps_of", "late_tensors"]


def _small(name: str, obj: Any, state: Any) -> Step:
    """A scheduler, GradScaler or data position: its own (small) state dict, copied, is what undo loads back."""

    def do() -> None:
        obj.load_state_dict(state)

    if isinstance(obj, ResumableDistributedSampler):  # its attributes, so that a live iterator goes on as it was
        return Step(name, lambda: dict(vars(obj)), do, lambda saved: _set_vars(obj, saved))
    return Step(name, lambda: copy.deepcopy(obj.state_dict()), do, obj.load_state_dict)


def _set_vars(obj: Any, saved: dict[str, Any]) -> None:
    vars(obj).clear()
    vars(obj).update(saved)


def _rng_step(plan: RestorePlan) -> Step:
    device = _rng.param_device(plan.objects.model)

    def save() -> tuple[dict[str, Any], int | None]:
        return _rng.rng_state_dict(device), _rng._base_seed  # seed_rng (a new rank's streams) sets the base seed

    def do() -> None:
        _rng.restore_rank_rng(plan.parts.rng, step=plan.parts.step, device=device, source=plan.source)

    def undo(saved: tuple[dict[str, Any], int | None]) -> None:
        _rng.load_rng_state_dict(saved[0], device)
        _rng._base_seed = saved[1]

    return Step("rng", save, do, undo)


def small_steps(plan: RestorePlan) -> list[Step]:
    """The steps of the small states ``plan.restore`` names: GradScaler, scheduler, data position, RNG. Local."""
    live, restore, steps = plan.objects, plan.restore, []
    if "scaler" in restore:
        steps.append(_small("scaler", live.scaler, plan.parts.scaler))
    if "scheduler" in restore:
        steps.append(_small("scheduler", live.scheduler, plan.parts.scheduler))
    if "sampler" in restore:
        steps.append(_small("sampler", live.data, plan.parts.sampler))
    if "rng" in restore:
        steps.append(_rng_step(plan))
    return steps


def committed_modules(plan: RestorePlan) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """The modules loaded at the commit, after the ranks agreed (those whose own load cannot raise), in order."""
    return [(name, module, state) for name, module, state in _modules(plan) if not can_raise(module)]


def _modules(plan: RestorePlan) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    out = [("model", plan.objects.model, plan.model_state)]
    if plan.objects.ema is not None and plan.ema_state is not None:
        out.append(("ema", plan.objects.ema, plan.ema_state))
    return out


def steps_of(plan: RestorePlan) -> list[Step]:
    """The steps that can fail, in apply's order: the small states, the optimizer, then each module whose own load
    can raise (:func:`can_raise`). The other modules are written at the commit. Local."""
    steps = small_steps(plan)
    if plan.objects.optimizer is not None and plan.optimizer_state is not None:
        steps.append(optimizer_step(plan))
    steps += [
        module_step(name, module, state, plan.strict) for name, module, state in _modules(plan) if can_raise(module)
    ]
    return steps


def late_tensors(plan: RestorePlan) -> list[torch.Tensor]:
    """The saved tensors whose data apply writes into live tensors only at the commit (the rest is used by the steps,
    so under a broadcast it must arrive before them): each entry of a committed module with a live destination, and
    every tensor of the optimizer's per-parameter state. Local."""
    out = [saved for _, module, state in committed_modules(plan) for saved, _ in module_pairs(module, state)]
    opt, saved_sd = plan.objects.optimizer, plan.optimizer_state
    if opt is not None and saved_sd is not None:
        for sid, _, _ in saved_state(opt, saved_sd):
            out += [v for v in (saved_sd["state"].get(sid) or {}).values() if isinstance(v, torch.Tensor)]
    return out
