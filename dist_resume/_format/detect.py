"""Recognise a checkpoint's parts by what they hold, not only by what they are called.

Rules, in order, for a dict (and the dicts one level inside it, paths ``"state.model"``):

1. ``part_keys`` names a key for a part: that key is used, whatever it holds.
2. A conventional name (``model``, ``state_dict``, ``model_state_dict``, ``optimizer``, ...) holding
   the right kind of value.
3. Content: a model is a mapping of str to tensors (the one that fits ``model_keys`` modulo
   ``module.``/``_orig_mod.``; without a model, the one that looks like a module's state, else the
   largest); an optimizer has ``state`` + ``param_groups``; a scheduler ``last_epoch`` with
   ``base_lrs`` or ``_last_lr``; a GradScaler ``scale`` with its growth settings; EMA weights are
   named ``model_ema``/``state_dict_ema``/``ema``/``ema_state_dict`` or hold ``n_averaged``.
   Two entries that could each be the same part are an error naming both, never a guess.

Epoch and step are plain numbers under the names in :data:`EPOCH_NAMES` / :data:`STEP_NAMES` (any case).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import torch

from .._core.errors import NotACheckpointError, UsageError
from .._core.text import preview
from .._state.prefix import canonical_key, match_keys

__all__ = [
    "PART_NAMES",
    "EPOCH_NAMES",
    "STEP_NAMES",
    "Detected",
    "detect_parts",
    "overrides",
    "is_state_dict",
    "as_int",
]

PART_NAMES: Final = ("model", "optimizer", "scheduler", "scaler", "ema", "epoch", "step")
EPOCH_NAMES: Final = ("epoch", "epochs_run", "finished_epoch", "current_epoch")
STEP_NAMES: Final = ("step", "global_step", "iteration", "iter", "iter_num", "num_steps")
_CONVENTIONAL: Final[dict[str, tuple[str, ...]]] = {
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
    if isinstance(value, (int, float)) and float(value).is_integer():
        return int(value)
    return None


def _one(value: Any) -> Any:
    """Lightning keeps one entry per optimizer / scheduler in a list: a list of one is that entry."""
    return value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value


def _is_rng(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dtype == torch.uint8 and value.dim() == 1
    if isinstance(value, Mapping):
        return {"python", "torch"} <= set(value) or (bool(value) and all(map(_is_rng, value.values())))
    return isinstance(value, (list, tuple)) and bool(value) and all(map(_is_rng, value))


def _kind(value: Any) -> str | None:
    """What an entry holds: model, ema, optimizer, scheduler, scaler, sampler, rng, or None."""
    if _is_rng(value):
        return "rng"
    if is_state_dict(value):
        return "ema" if "n_averaged" in value else "model"
    one = _one(value)
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


class _Entry(NamedTuple):
    path: str  # "key", or "outer.inner" one level down
    container: str | None  # "outer" one level down
    name: str  # the key itself
    value: Any
    kind: str | None


def _entries(obj: Mapping[str, Any]) -> list[_Entry]:
    """Every top-level entry, then every entry of a plain dict one level down (not of a part)."""
    out = [_Entry(str(k), None, str(k), v, _kind(v)) for k, v in obj.items()]
    for top in list(out):
        if isinstance(top.value, Mapping) and top.kind is None:
            out += [_Entry(f"{top.path}.{k}", top.path, str(k), v, _kind(v)) for k, v in top.value.items()]
    return out


@dataclass(frozen=True)
class Detected:
    """Where each part of a checkpoint is: ``values`` and ``keys`` (part -> key path), and what is left."""

    values: dict[str, Any]
    keys: dict[str, str]
    extra: dict[str, Any] | None


def resolve_key(obj: Mapping[str, Any], path: str, part: str, source: str) -> Any:
    """The value at ``path`` (a top-level key, or ``outer.inner`` one level down); a clear error if absent."""
    if path in obj:
        return obj[path]
    outer, _, inner = path.partition(".")
    if inner and isinstance(obj.get(outer), Mapping) and inner in obj[outer]:
        return obj[outer][inner]
    raise NotACheckpointError(
        f"part_keys names {path!r} for the {part}, but {source} has no such key; its keys are "
        f"{preview((e.path for e in _entries(obj)), 12)} (use 'outer.inner' for a key one level down)"
    )


def check_part_keys(part_keys: Mapping[str, str] | None) -> dict[str, str]:
    """``part_keys`` validated: only known part names, string keys."""
    if not part_keys:
        return {}
    unknown = [name for name in part_keys if name not in PART_NAMES]
    if unknown:
        raise UsageError(
            f"part_keys names unknown part(s) {preview(unknown)}",
            hint=f"the parts are {preview(PART_NAMES, len(PART_NAMES))}",
        )
    bad = [name for name, key in part_keys.items() if not isinstance(key, str) or not key]
    if bad:
        raise UsageError(f"part_keys must map each part to a key (a non-empty str); {preview(bad)} do not")
    return dict(part_keys)


def _overridden(obj: Mapping[str, Any], part: str, path: str, source: str) -> Any:
    value = resolve_key(obj, path, part, source)
    if part == "model" and not is_state_dict(value):
        raise NotACheckpointError(
            f"part_keys names {path!r} for the model, but it holds {type(value).__name__}, "
            "not a state dict (a mapping of names to tensors)"
        )
    if part in ("epoch", "step"):
        number = as_int(value)
        if number is None and not (isinstance(value, torch.Tensor) and value.is_meta):
            raise NotACheckpointError(f"part_keys names {path!r} for the {part}, but it holds {value!r}, not a number")
        return number
    return _one(value)


def overrides(obj: Mapping[str, Any], part_keys: Mapping[str, str] | None, source: str) -> dict[str, Any]:
    """``{part: value}`` for the parts ``part_keys`` names (validated: known names, keys that exist)."""
    return {part: _overridden(obj, part, path, source) for part, path in check_part_keys(part_keys).items()}


def _ambiguous(part: str, paths: list[str], source: str, model_hint: bool) -> NotACheckpointError:
    how = f"choose one with part_keys={{{part!r}: {paths[0]!r}}}"
    if model_hint:
        how += " (or pass the model, whose keys pick the entry that fits it)"
    return NotACheckpointError(
        f"{source} has {len(paths)} entries that could each be the {part}: {preview(paths, 8)}; "
        f"dist_resume does not guess: {how}"
    )


def _fit(value: Mapping[str, Any], targets: dict[str, str]) -> tuple[bool, bool]:
    """(every key pairs with a model key and covers the model, some key pairs)."""
    pairs = match_keys(list(value), targets)
    return len(pairs) == len(value) and len(set(pairs.values())) == len(targets), bool(pairs)


def _numel(value: Mapping[str, Any]) -> int:
    return sum(v.numel() for v in value.values() if isinstance(v, torch.Tensor))


def _looks_like_module(value: Mapping[str, Any]) -> bool:
    return any("." in k or k.endswith(("weight", "bias")) for k in value)


def _pick_model(cands: dict[str, Any], conv: str | None, model_keys: Collection[str] | None, source: str) -> str | None:
    if model_keys is not None and cands:
        targets = {canonical_key(k): k for k in model_keys}
        fits = {p: _fit(v, targets) for p, v in cands.items()}
        full = [p for p, (whole, _) in fits.items() if whole]
        if conv in full or len(full) == 1:
            return conv if conv in full else full[0]
        if len(full) > 1:
            raise _ambiguous("model", full, source, model_hint=False)
        some = [p for p, (_, part) in fits.items() if part]
        if conv is None and len(some) == 1:
            return some[0]
        if conv is None and len(some) > 1:
            raise _ambiguous("model", some, source, model_hint=False)
    if conv is not None:
        return conv
    like = [p for p, v in cands.items() if _looks_like_module(v)]
    if len(like) == 1:
        return like[0]
    if len(like) > 1:
        raise _ambiguous("model", like, source, model_hint=model_keys is None)
    sizes = sorted(((_numel(v), p) for p, v in cands.items()), reverse=True)
    if len(sizes) > 1 and sizes[0][0] == sizes[1][0]:
        raise _ambiguous("model", [p for _, p in sizes], source, model_hint=model_keys is None)
    return sizes[0][1] if sizes else None


def detect_parts(
    obj: Mapping[str, Any],
    source: str = "checkpoint",
    *,
    model_keys: Collection[str] | None = None,
    part_keys: Mapping[str, str] | None = None,
) -> Detected:
    """Find model, optimizer, scheduler, scaler, EMA, sampler, RNG, epoch and step in ``obj``. Local.

    Raises :class:`NotACheckpointError` when two entries could each be the same part, or when a key
    named in ``part_keys`` is absent; :class:`UsageError` for an unknown part name.
    """
    chosen = check_part_keys(part_keys)
    values = overrides(obj, chosen, source)
    entries = _entries(obj)
    taken = set(chosen.values())
    for part in ("ema", "model", "optimizer", "scheduler", "scaler", "sampler", "rng"):
        if part in chosen:
            continue
        free = [e for e in entries if e.path not in taken]
        cands = {e.path: e.value for e in free if _candidate(part, e)}
        conv = _conventional(part, free)
        if part == "model":
            path = _pick_model(cands, conv, model_keys, source)
        elif conv is not None:
            path = conv
        elif len(cands) > 1 and part not in ("sampler", "rng"):
            raise _ambiguous(part, list(cands), source, model_hint=False)
        else:
            path = next(iter(cands)) if len(cands) == 1 else None
        if path is not None:
            value = next(e.value for e in free if e.path == path)
            values[part] = [value] if part == "rng" and isinstance(value, Mapping) else _one(value)
            chosen[part] = path
            taken.add(path)
    model = next((e for e in entries if e.path == chosen.get("model")), None)
    homes = (None, model.container) if model is not None and model.container else (None,)
    for part, names in (("epoch", EPOCH_NAMES), ("step", STEP_NAMES)):
        for home in homes:
            found = [
                (names.index(e.name.lower()), e.path, number)
                for e in entries
                if e.container == home and e.name.lower() in names and (number := as_int(e.value)) is not None
            ]
            if found and part not in chosen:
                _, chosen[part], values[part] = min(found)
    return Detected(values, chosen, _rest(obj, taken))


def _candidate(part: str, entry: _Entry) -> bool:
    """Whether an entry's content makes it a candidate for ``part``."""
    if part == "model":  # EMA names are never the model; an AveragedModel's state is, under a model name
        if not is_state_dict(entry.value) or entry.kind == "rng" or entry.name in _CONVENTIONAL["ema"]:
            return False
        return entry.kind == "model" or entry.name in _CONVENTIONAL["model"]
    if part == "ema":
        return entry.kind == "ema" and entry.name not in _CONVENTIONAL["model"]
    if part == "rng":  # only the per-rank form this toolkit restores (one rng_state_dict() or a list of them)
        states = entry.value if isinstance(entry.value, (list, tuple)) else [entry.value]
        return entry.kind == "rng" and all(isinstance(v, Mapping) and {"python", "torch"} <= set(v) for v in states)
    return entry.kind == part


def _conventional(part: str, free: list[_Entry]) -> str | None:
    """The entry under a conventional name for ``part`` holding the right kind of value (shallowest, by priority).

    The same name in two containers is no convention: content decides (and finds them ambiguous).
    """
    names = _CONVENTIONAL.get(part, ())
    holders = {e.container for e in free if e.kind == part}  # "optimizer": {"g": ..., "d": ...} holds two
    kinds = {part, None, "model"} if part == "ema" else {part, None}
    found = []
    for e in free:
        if e.name not in names or e.path in holders:
            continue
        if _candidate(part, e) if part == "model" else isinstance(_one(e.value), Mapping) and e.kind in kinds:
            found.append(((e.container is not None, names.index(e.name)), e.path))
    found.sort()
    if not found or (len(found) > 1 and found[0][0] == found[1][0]):
        return None
    return found[0][1]


def _rest(obj: Mapping[str, Any], taken: set[str]) -> dict[str, Any] | None:
    """``obj`` without the entries used as parts (numbers stay: they are read, not restored)."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        if key in taken:
            continue
        inner = {k: v for k, v in value.items() if f"{key}.{k}" not in taken} if isinstance(value, Mapping) else None
        if inner is not None and len(inner) < len(value):
            if inner:
                out[key] = inner
        else:
            out[key] = value
    return out or None
