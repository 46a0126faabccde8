"""What a checkpoint entry holds, by its content: the value kinds layout detection works with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, NamedTuple

import torch

__all__ = [
    "PART_NAMES",
    "EPOCH_NAMES",
    "STEP_NAMES",
    "CONVENTIONAL",
    "Entry",
    "entries",
    "value_kind",
    "is_state_dict",
    "is_rng",
    "as_int",
    "one_entry",
]

PART_NAMES: Final = ("model", "optimizer", "scheduler", "scaler", "ema", "epoch", "step")
EPOCH_NAMES: Final = ("epoch", "epochs_run", "finished_epoch", "current_epoch")
STEP_NAMES: Final = ("step", "global_step", "iteration", "iter", "iter_num", "num_steps", "it")
CONVENTIONAL: Final[dict[str, tuple[str, ...]]] = {
    "ema": ("model_ema", "state_dict_ema", "ema", "ema_state_dict"),
    "model": ("model_state_dict", "model", "state_dict"),
    "optimizer": ("optimizer_state_dict", "optimizer", "optim", "optimizer_states"),
    "scheduler": ("scheduler_state_dict", "lr_scheduler_state_dict", "scheduler", "lr_scheduler", "lr_schedulers"),
    "scaler": ("scaler_state_dict", "scaler", "grad_scaler"),
}
_SCALER_SETTINGS: Final = ("growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_SAMPLER_KEYS: Final = frozenset({"epoch", "consumed", "num_samples"})


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


def as_int(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (or a one-element tensor holding one), else None."""
    if isinstance(value, torch.Tensor) and value.is_meta:  # read without data (dist-resume inspect)
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool):
        return None
    if isinstance(value, int):  # float() of one past 1e308 would overflow
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def one_entry(value: Any) -> Any:
    """Lightning keeps one entry per optimizer / scheduler in a list: a list of one is that entry."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def is_rng(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.uint8 and value.dim() == 1
    if isinstance(value, Mapping):
        return {"python", "torch"} <= set(value) or (bool(value) and all(map(is_rng, value.values())))
    return isinstance(value, (list, tuple)) and bool(value) and all(map(is_rng, value))


def value_kind(value: Any) -> str | None:
    """What an entry holds: model, ema, optimizer, scheduler, scaler, sampler, rng, or None."""
    if is_rng(value):
        return "rng"
    if is_state_dict(value):
        return "ema" if "n_averaged" in value else "model"
    one = one_entry(value)
    if not isinstance(one, Mapping):
        return None
    keys = set(one)
    if {"state", "param_groups"} <= keys:
        return "optimizer"
    if "last_epoch" in keys and ("base_lrs" in keys or "_last_lr" in keys):
        return "scheduler"
    if "scale" in keys and any(k in keys for k in _SCALER_SETTINGS):
        return "scaler"
    if _SAMPLER_KEYS <= keys and one is value:
        return "sampler"
    return None


class Entry(NamedTuple):
    path: str  # "key", or "outer.inner" one level down
    container: str | None  # "outer" one level down
    name: str  # the key itself
    value: Any
    kind: str | None


def entries(obj: Mapping[str, Any]) -> list[Entry]:
    """Every top-level entry, then every entry of a plain dict one level down (not of a part)."""
    out = [Entry(str(k), None, str(k), v, value_kind(v)) for k, v in obj.items()]
    for top in list(out):
        if isinstance(top.value, Mapping) and top.kind is None:
            out += [Entry(f"{top.path}.{k}", top.path, str(k), v, value_kind(v)) for k, v in top.value.items()]
    return out
