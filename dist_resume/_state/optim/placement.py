"""Optimizer state on its parameters' devices: :func:`optimizer_to`, and torch's policy for where ``step`` lives."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..._core.tree import map_tensors

__all__ = ["optimizer_to", "step_on_param_device"]


def step_on_param_device(group: Mapping[str, Any]) -> bool:
    """torch's policy: ``step`` lives on the parameter's device only for fused or capturable groups."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


def _params_with_groups(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p, group


def optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> torch.optim.Optimizer:
    """Move each per-parameter state tensor onto its parameter's device (or onto ``device``).

    Local. Follows torch's own policy: ``step`` stays on the CPU unless the group is ``fused`` or
    ``capturable`` (an accelerator ``step`` on a plain Adam forces a host sync per parameter per step),
    dtypes never change, and a tensor already in place is not copied. Returns ``optimizer``.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> dist_resume.optimizer_to(opt) is opt   # after model.to(device)
        True
    """
    target = torch.device(device) if device is not None else None
    for p, group in _params_with_groups(optimizer):
        state = optimizer.state.get(p)
        if not state:
            continue
        where = target or p.device
        for key, value in state.items():
            if key == "step" and not step_on_param_device(group):
                dest = torch.device("cpu")
            else:
                dest = where
            moved = _moved(value, dest)
            if moved is not value:
                state[key] = moved
    return optimizer


def _moved(value: Any, dest: torch.device) -> Any:
    """``value`` with every tensor in it on ``dest``; the same object when nothing had to move.

    Recurses into lists, tuples and dicts like torch's own ``load_state_dict`` (LBFGS keeps its
    history as lists of tensors).
    """
    return map_tensors(value, lambda t: t if t.device == dest else t.to(dest), share_unchanged=True)
