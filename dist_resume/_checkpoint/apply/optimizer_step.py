"""The optimizer's step of apply: torch's ``Optimizer.load_state_dict`` on live state tensors, the data left for the
commit.

torch's load is given the optimizer's own state tensors where they fit (their data untouched), and new ones where the
optimizer has none yet (placed as torch's own policy places them: FACTS 2), so undo only swaps the optimizer's
containers back, nothing is copied, and the saved data goes into those tensors at the commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..._state.optim.placement import optimizer_to, step_on_param_device
from .inplace import detach_from_file, storage_ptrs
from .step import Pairs, RestorePlan, Step

__all__ = ["optimizer_step", "optimizer_load_step", "saved_state"]


@dataclass(frozen=True)
class _OptimizerBefore:
    state: Any  # the optimizer's own containers: torch's load_state_dict replaces them, it never edits them
    groups: list[dict[str, Any]]
    group_items: list[dict[str, Any]]
    defaults: dict[str, Any]


def saved_state(
    opt: torch.optim.Optimizer, saved_sd: dict[str, Any]
) -> Iterator[tuple[Any, torch.Tensor, dict[str, Any]]]:
    """``(saved id, live parameter, its group)`` in the order torch pairs them (by position)."""
    saved_ids = (i for group in saved_sd["param_groups"] for i in group["params"])
    live = ((p, group) for group in opt.param_groups for p in group["params"])
    for sid, (param, group) in zip(saved_ids, live):
        yield sid, param, group


def _twin(
    opt: torch.optim.Optimizer, param: torch.Tensor, group: dict[str, Any], key: str, value: torch.Tensor
) -> torch.Tensor:
    """The live state tensor the saved ``value`` goes into: the optimizer's own where it has one of the same shape and
    dtype, else a new one placed as torch's ``load_state_dict`` would place it (``step`` stays as saved unless the
    group is fused or capturable; other state takes the parameter's device, and its dtype where the parameter is
    floating point)."""
    live = opt.state.get(param, {}).get(key)
    if isinstance(live, torch.Tensor) and live.shape == value.shape and live.dtype == value.dtype:
        return live
    if key == "step":
        on_param = step_on_param_device(group)
        dtype, device = (torch.float32, param.device) if on_param else (value.dtype, torch.device("cpu"))
    else:
        dtype = param.dtype if param.is_floating_point() else value.dtype
        device = param.device
    return torch.empty(value.shape, dtype=dtype, device=device)


def _keep_optimizer(
    opt: torch.optim.Optimizer,
) -> tuple[Callable[[], _OptimizerBefore], Callable[[_OptimizerBefore], None]]:
    """``save`` and ``undo`` of an optimizer step: its containers, which torch's ``load_state_dict`` replaces."""

    def save() -> _OptimizerBefore:
        groups = opt.param_groups
        return _OptimizerBefore(opt.state, groups, [dict(g) for g in groups], dict(opt.defaults))

    def undo(before: _OptimizerBefore) -> None:
        for group, items in zip(before.groups, before.group_items):
            group.clear()
            group.update(items)
        opt.defaults.clear()
        opt.defaults.update(before.defaults)
        vars(opt).update(state=before.state, param_groups=before.groups)

    return save, undo


def optimizer_step(plan: RestorePlan) -> Step:
    """torch's ``load_state_dict`` given live state tensors (:func:`_twin`) for every saved state tensor; the saved
    data goes into them at the commit (the pairs ``do`` returns)."""
    opt, saved_sd = plan.objects.optimizer, plan.optimizer_state
    assert opt is not None and saved_sd is not None

    def do() -> Pairs:
        state = {sid: dict(entries) for sid, entries in saved_sd["state"].items()}
        saved: list[tuple[torch.Tensor, torch.Tensor, str]] = []  # (saved tensor, parameter, key)
        for sid, param, group in saved_state(opt, saved_sd):
            for key, value in (saved_sd["state"].get(sid) or {}).items():
                if isinstance(value, torch.Tensor):
                    state[sid][key] = _twin(opt, param, group, key, value)
                    saved.append((value, param, key))
        opt.load_state_dict({**saved_sd, "state": state})
        optimizer_to(opt)
        if plan.mmapped:  # what torch kept as it was (nested state, as LBFGS's lists) must not map the file
            detach_from_file(opt, storage_ptrs(plan.parts.optimizer))
        return [(value, opt.state[param][key]) for value, param, key in saved]  # wherever torch placed it

    save, undo = _keep_optimizer(opt)
    return Step("optimizer", save, do, undo)


def optimizer_load_step(
    opt: torch.optim.Optimizer, state_dict: dict[str, Any], destinations: Sequence[torch.Tensor]
) -> Step:
    """torch's ``load_state_dict`` of ``state_dict`` whose state tensors are the ``destinations`` a later fill writes
    (an FSDP2 optimizer's DTensors); it fails, to be put back, if torch kept any of them as anything else."""

    def do() -> None:
        opt.load_state_dict(state_dict)
        optimizer_to(opt)
        kept = {id(t) for entries in opt.state.values() for t in entries.values() if isinstance(t, torch.Tensor)}
        replaced = sum(id(d) not in kept for d in destinations)
        if replaced:
            raise RuntimeError(
                f"Optimizer.load_state_dict placed {replaced} of the {len(destinations)} state tensors anew instead of "
                "keeping them, so the fill could not reach them"
            )

    save, undo = _keep_optimizer(opt)
    return Step("optimizer", save, do, undo)
