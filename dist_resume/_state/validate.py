"""Checks of a checkpoint's model dtypes, LR scheduler, GradScaler and RNG state against the live objects."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._core.errors import KeyMismatchError, StateMismatchError
from .._core.text import article, preview

__all__ = ["check_dtypes", "check_scheduler", "check_scaler", "check_rng_states"]


def check_dtypes(adapted: Mapping[str, Any], model: nn.Module, strict: bool, source: str) -> None:
    live = model.state_dict(keep_vars=True)
    problems = []
    for key, value in adapted.items():
        want = live.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor)) or value.dtype == want.dtype:
            continue
        cast_ok = value.is_floating_point() and want.is_floating_point()
        if strict or not cast_ok:
            problems.append(f"{key}: checkpoint {value.dtype}, model {want.dtype}")
    if problems:
        shown = preview(problems, 5, sep="; ", quote=False)
        raise KeyMismatchError(
            f"{source}: dtypes differ ({shown}); convert the model (model.to(dtype)) to the checkpoint's dtype "
            "before resuming, or pass strict=False to cast floating-point tensors on load",
            mismatched=problems,
        )


def check_scheduler(saved: Any, scheduler: Any, source: str) -> None:
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{source}: the scheduler entry is {article(type(saved).__name__)}, not a state dict")
    live = scheduler.state_dict()
    if set(saved) != set(live):
        raise StateMismatchError(
            f"{source}: the saved LR scheduler state does not fit {type(scheduler).__name__} (saved keys "
            f"{sorted(set(saved) - set(live))} not expected, {sorted(set(live) - set(saved))} missing); "
            "build the same scheduler class as the run that saved it"
        )


# what GradScaler.load_state_dict reads from an enabled scaler's state (torch 2.x): each a plain number
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


def check_scaler(saved: Any, scaler: Any, source: str) -> None:
    """Raise :class:`StateMismatchError` unless ``scaler.load_state_dict(saved)`` can only succeed. Local.

    A disabled scaler ignores what it is given; an enabled one needs every number it reads.
    """
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{source}: the GradScaler entry is {article(type(saved).__name__)}, not a state dict")
    if not scaler.is_enabled():
        return
    if not saved:
        raise StateMismatchError(
            f"{source}: the GradScaler state is empty (it was saved from a disabled scaler) but this scaler is "
            "enabled; pass strict=False to keep the scaler's fresh state"
        )
    problems = [
        f"{key}: {'missing' if key not in saved else type(saved[key]).__name__}"
        for key in _SCALER_KEYS
        if not _is_number(saved.get(key))
    ]
    if problems:
        raise StateMismatchError(
            f"{source}: the GradScaler state is not one GradScaler.state_dict() writes ({'; '.join(problems)}; "
            f"expected numbers under {list(_SCALER_KEYS)}); the checkpoint is damaged or was edited: resume "
            "from another checkpoint, or restore without the scaler and keep its fresh state"
        )


def _is_number(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rng_states(states: Any, rank: int, source: str) -> None:
    """Raise :class:`StateMismatchError` if ``rank`` cannot restore its RNG streams from ``states``. Local.

    ``states`` is a checkpoint's per-rank list (None: the file has none, nothing to check). A rank
    within the list needs its own entry; a rank beyond it derives its streams from entry 0's seed.
    """
    if states is None:
        return
    if not isinstance(states, (list, tuple)) or not states:
        raise StateMismatchError(
            f"{source}: the RNG entry is {article(type(states).__name__)}, not a list of per-rank states"
        )
    own = rank < len(states)
    entry, needed = (states[rank], {"python", "torch"}) if own else (states[0], {"seed"})
    if not isinstance(entry, Mapping) or not needed <= set(entry):
        found = sorted(entry) if isinstance(entry, Mapping) else type(entry).__name__
        raise StateMismatchError(
            f"{source}: the RNG state of rank {rank if own else 0} lacks {sorted(needed)} (found {found}); "
            "it was not written by save_checkpoint(rng=True); resume with ResumeOptions(rng=False) to keep the current streams"
        )
