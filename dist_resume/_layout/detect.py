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
from typing import Any

import torch

from .._core.errors import NotACheckpointError, UsageError
from .._core.text import preview
from .._state.prefix import canonical_key, match_keys
from .kinds import (
    CONVENTIONAL,
    EPOCH_NAMES,
    PART_NAMES,
    STEP_NAMES,
    Entry,
    as_int,
    entries,
    is_state_dict,
    one_entry,
)

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
        f"{preview((e.path for e in entries(obj)), 12)} (use 'outer.inner' for a key one level down)"
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
            raise NotACheckpointError(
                f"part_keys names {path!r} for the {part}, but it holds {_held(value)}, not a whole number"
            )
        return number
    return one_entry(value)


def _held(value: Any) -> str:
    """A short description of a value for an error (a state dict's repr would fill the screen)."""
    if isinstance(value, (int, float, str)) and len(repr(value)) <= 40:
        return repr(value)
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}" + (
        f" with {len(value)} entries" if isinstance(value, (Mapping, list, tuple)) else ""
    )


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
    wanted: Collection[str] | None = None,
) -> Detected:
    """Find model, optimizer, scheduler, scaler, EMA, sampler, RNG, epoch and step in ``obj``. Local.

    Raises :class:`NotACheckpointError` when two entries could each be the same part, or when a key
    named in ``part_keys`` is absent; :class:`UsageError` for an unknown part name. ``wanted`` names
    the parts the caller will use (``resume``: the objects it was given); two candidates for a part
    outside it (a GAN file's two optimizers, resumed without an optimizer) are left in ``extra``
    instead of refused. The model, epoch and step are always wanted.
    """
    chosen = check_part_keys(part_keys)
    values = overrides(obj, chosen, source)
    every = entries(obj)
    taken = set(chosen.values())
    for part in ("ema", "model", "optimizer", "scheduler", "scaler", "sampler", "rng"):
        if part in chosen:
            continue
        free = [e for e in every if e.path not in taken]
        cands = {e.path: e.value for e in free if _candidate(part, e)}
        conv = _conventional(part, free)
        if part == "model":
            path = _pick_model(cands, conv, model_keys, source)
        elif conv is not None:
            path = conv
        elif len(cands) > 1 and part not in ("sampler", "rng"):
            if wanted is None or part in wanted:
                raise _ambiguous(part, list(cands), source, model_hint=False)
            path = None
        else:
            path = next(iter(cands)) if len(cands) == 1 else None
        if path is not None:
            value = next(e.value for e in free if e.path == path)
            values[part] = [value] if part == "rng" and isinstance(value, Mapping) else one_entry(value)
            chosen[part] = path
            taken.add(path)
    for part, names in (("epoch", EPOCH_NAMES), ("step", STEP_NAMES)):
        if part not in chosen and (counter := _counter(part, names, every, chosen.get("model"), source)) is not None:
            chosen[part], values[part] = counter
    return Detected(values, chosen, _rest(obj, taken))


def _counter(
    part: str, names: tuple[str, ...], every: list[Entry], model_path: str | None, source: str
) -> tuple[str, int] | None:
    """Where the epoch (or step) is: top level first, then beside the model, then in any other plain dict.

    In the first place that has one, the name earliest in ``names`` wins (``epoch`` before
    ``finished_epoch``); names of equal rank (``Epoch`` and ``epoch``, ``a.step`` and ``b.step``)
    holding different numbers are an error, never a guess.
    """
    model_home = next((e.container for e in every if e.path == model_path), None)
    found = [
        (names.index(e.name.lower()), e.container, e.path, number)
        for e in every
        if e.name.lower() in names and (number := as_int(e.value)) is not None
    ]
    for tier in (lambda c: c is None, lambda c: c is not None and c == model_home, lambda c: c is not None):
        here = [f for f in found if tier(f[1])]
        if not here:
            continue
        best = min(rank for rank, *_ in here)
        first = [(path, number) for rank, _, path, number in here if rank == best]
        if len({number for _, number in first}) > 1:
            shown = ", ".join(f"{path!r} = {number}" for path, number in first)
            raise NotACheckpointError(
                f"{source} has {len(first)} entries that could each be the {part}, with different numbers: "
                f"{shown}; dist_resume does not guess: choose one with part_keys={{{part!r}: {first[0][0]!r}}}"
            )
        return first[0]
    return None


def _candidate(part: str, entry: Entry) -> bool:
    """Whether an entry's content makes it a candidate for ``part``."""
    if part == "model":  # EMA names are never the model; an AveragedModel's state is, under a model name
        if not is_state_dict(entry.value) or entry.kind == "rng" or entry.name in CONVENTIONAL["ema"]:
            return False
        return entry.kind == "model" or entry.name in CONVENTIONAL["model"]
    if part == "ema":
        return entry.kind == "ema" and entry.name not in CONVENTIONAL["model"]
    if part == "rng":  # only the per-rank form this toolkit restores (one rng_state_dict() or a list of them)
        states = entry.value if isinstance(entry.value, (list, tuple)) else [entry.value]
        return entry.kind == "rng" and all(isinstance(v, Mapping) and {"python", "torch"} <= set(v) for v in states)
    return entry.kind == part


def _conventional(part: str, free: list[Entry]) -> str | None:
    """The entry under a conventional name for ``part`` holding the right kind of value (shallowest, by priority).

    The same name in two containers is no convention: content decides (and finds them ambiguous).
    """
    names = CONVENTIONAL.get(part, ())
    holders = {e.container for e in free if e.kind == part}  # "optimizer": {"g": ..., "d": ...} holds two
    kinds = {part, None, "model"} if part == "ema" else {part, None}
    found = []
    for e in free:
        if e.name not in names or e.path in holders:
            continue
        if _candidate(part, e) if part == "model" else isinstance(one_entry(e.value), Mapping) and e.kind in kinds:
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
