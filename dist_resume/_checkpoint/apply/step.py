"""A step of apply, and what a step sees of the plan.

A :class:`Step` ``save`` s what its ``do`` changes and can ``undo`` it. ``do`` may return :data:`Pairs`: saved tensors
(data, or a broadcast's stand-ins) and the live tensors their data goes into at the commit, once every step on every
rank succeeded (see :mod:`~dist_resume._checkpoint.apply.transaction`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..._layout.layout import CheckpointParts
from ..objects import LiveObjects

__all__ = ["Pairs", "Step", "RestorePlan"]

Pairs = list[tuple[torch.Tensor, torch.Tensor]]  # (saved tensor or stand-in, the live tensor its data goes into)


class RestorePlan(Protocol):
    """What apply reads of :class:`~dist_resume._checkpoint.plan.restore_plan.RestorePlan` (which imports this module)."""

    @property
    def parts(self) -> CheckpointParts: ...
    @property
    def objects(self) -> LiveObjects: ...
    @property
    def restore(self) -> tuple[str, ...]: ...
    @property
    def model_state(self) -> Any: ...
    @property
    def optimizer_state(self) -> dict[str, Any] | None: ...
    @property
    def ema_state(self) -> Any: ...
    @property
    def strict(self) -> bool: ...
    @property
    def mmapped(self) -> bool: ...
    @property
    def source(self) -> str: ...
    @property
    def notices(self) -> tuple[tuple[int, str], ...]: ...


@dataclass(frozen=True)
class Step:
    """One part of apply: ``save()`` what ``do()`` changes, ``do()`` change it (returning the data to write at the
    commit, or None), ``undo(saved)`` put it back."""

    name: str
    save: Callable[[], Any]
    do: Callable[[], Pairs | None]
    undo: Callable[[Any], None]
