"""Checkpoint layouts: this toolkit's file format, and the foreign layouts people commonly save."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from .._core.errors import NotACheckpointError

__all__ = ["FORMAT_NAME", "FORMAT_VERSION", "Key", "Layout", "CheckpointParts", "split_checkpoint", "is_state_dict"]

FORMAT_NAME: Final = "dist_resume"
FORMAT_VERSION: Final = 1


class Key:
    """Top-level keys of a dist_resume checkpoint, defined once."""

    FORMAT: Final = "format"
    VERSION: Final = "format_version"
    MODEL: Final = "model"
    OPTIMIZER: Final = "optimizer"
    SCHEDULER: Final = "scheduler"
    SCALER: Final = "scaler"
    META: Final = "meta"
    EXTRA: Final = "extra"
    RNG: Final = "rng"
    SAMPLER: Final = "sampler"
    EMA: Final = "ema"


class Layout(enum.Enum):
    """How the objects are arranged in a checkpoint file."""

    TOOLKIT = "dist_resume"
    BARE = "bare state dict"
    MODEL_OPTIMIZER = "model+optimizer"
    STATE_DICT = "state_dict"
    MODEL_STATE_DICT = "model_state_dict"


@dataclass(frozen=True)
class CheckpointParts:
    """A checkpoint split into the pieces ``resume`` restores."""

    layout: Layout
    model: Mapping[str, Any]
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    step: int | None = None
    epoch: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: Any = None
    rng: Any = None
    sampler: Any = None


# foreign layouts: (layout, model key, optimizer keys, scheduler keys, scaler keys)
_FOREIGN: Final = (
    (
        Layout.MODEL_STATE_DICT,
        "model_state_dict",
        ("optimizer_state_dict", "optimizer"),
        ("scheduler_state_dict", "lr_scheduler_state_dict", "scheduler"),
        ("scaler_state_dict", "scaler"),
    ),
    (Layout.MODEL_OPTIMIZER, "model", ("optimizer", "optim"), ("scheduler", "lr_scheduler"), ("scaler", "grad_scaler")),
    (
        Layout.STATE_DICT,
        "state_dict",
        ("optimizer", "optimizer_state_dict", "optimizer_states"),
        ("scheduler", "lr_scheduler", "lr_schedulers"),
        ("scaler", "grad_scaler"),
    ),
)
_STEP_KEYS: Final = ("step", "global_step", "iteration", "iter_num")


def is_state_dict(obj: Any) -> bool:
    """True for a mapping of string keys to tensors (``_extra_state`` entries may hold anything)."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    has_tensor = False
    for key, value in obj.items():
        if not isinstance(key, str):
            return False
        if isinstance(value, torch.Tensor):
            has_tensor = True
        elif not key.endswith("_extra_state"):
            return False
    return has_tensor


def _first(obj: Mapping[str, Any], keys: tuple[str, ...]) -> tuple[str | None, Any]:
    for key in keys:
        if key in obj:
            value = obj[key]
            if isinstance(value, (list, tuple)) and len(value) == 1:  # Lightning: one entry per optimizer
                value = value[0]
            return key, value
    return None, None


def _as_int(value: Any) -> int | None:
    if isinstance(value, torch.Tensor) and value.is_meta:  # read without data (dist-resume inspect)
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    return None


def split_checkpoint(obj: Any, source: str = "checkpoint") -> CheckpointParts:
    """Recognise the layout of a loaded checkpoint and split it into its parts.

    Raises :class:`NotACheckpointError` naming the top-level keys when no layout fits.
    """
    if isinstance(obj, Mapping) and obj.get(Key.FORMAT) == FORMAT_NAME:
        meta = dict(obj.get(Key.META) or {})
        if not isinstance(obj.get(Key.MODEL), Mapping):
            raise NotACheckpointError(f"{source} is marked as a dist_resume checkpoint but has no model state")
        return CheckpointParts(
            Layout.TOOLKIT,
            obj[Key.MODEL],
            obj.get(Key.OPTIMIZER),
            obj.get(Key.SCHEDULER),
            obj.get(Key.SCALER),
            _as_int(meta.get("step")),
            _as_int(meta.get("epoch")),
            meta,
            obj.get(Key.EXTRA),
            obj.get(Key.RNG),
            obj.get(Key.SAMPLER),
        )
    if is_state_dict(obj):
        return CheckpointParts(Layout.BARE, obj)
    if isinstance(obj, Mapping):
        for layout, model_key, opt_keys, sched_keys, scaler_keys in _FOREIGN:
            if model_key in obj and is_state_dict(obj[model_key]):
                used = {model_key}
                parts: list[Any] = []
                for keys in (opt_keys, sched_keys, scaler_keys):
                    key, value = _first(obj, keys)
                    parts.append(value)
                    if key is not None:
                        used.add(key)
                _, step = _first(obj, _STEP_KEYS)
                extra = {k: v for k, v in obj.items() if k not in used}
                optimizer, scheduler, scaler = parts
                return CheckpointParts(
                    layout,
                    obj[model_key],
                    optimizer,
                    scheduler,
                    scaler,
                    step=_as_int(step),
                    epoch=_as_int(obj.get("epoch")),
                    extra=extra or None,
                )
        shown = ", ".join(repr(k) for k in list(obj)[:8])
        raise NotACheckpointError(
            f"{source} has no model state dict in a layout dist_resume knows (top-level keys: {shown}); "
            "expected a state dict, or a dict with 'model', 'state_dict' or 'model_state_dict'; "
            "pass the model's state dict yourself (adapt_state_dict + load_state_dict)"
        )
    raise NotACheckpointError(
        f"{source} holds a {type(obj).__name__}, not a state dict or a dict of them; "
        "save model.state_dict() (or a dict holding it) rather than the module itself"
    )
