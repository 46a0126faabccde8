"""Fitting a checkpoint's model state to a live model: re-keying across wrappers, checks, and what to do."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from .._core.errors import KeyMismatchError
from .._core.tensor_kind import tensor_kind
from .._core.text import article, preview
from .prefix import match_keys, model_key_map, prefix_style, unwrap_model, wrapper_prefix
from .subtree import select_prefix, suggest_key_prefix

__all__ = ["adapt_state_dict"]


def adapt_state_dict(
    state_dict: Mapping[str, Any], model: nn.Module, *, strict: bool = True, key_prefix: str | None = None
) -> OrderedDict[str, Any]:
    """Re-key a checkpoint's model state to exactly ``model.state_dict()``'s key form.

    Local; no tensor is copied. Works for any ``module.`` / ``_orig_mod.`` wrapping on either side:
    plain, DDP, DataParallel, compiled, ``module.module.``, ``_orig_mod.module.``,
    ``module._orig_mod.``. Raises :class:`KeyMismatchError` listing missing, unexpected and
    mismatched keys (another shape, or not a dense tensor where the model has one); with ``strict=False``
    missing and unexpected keys are allowed (the unexpected ones are dropped) but mismatches still
    raise. ``key_prefix`` (e.g. ``"model."`` for a LightningModule's ``self.model``) takes only the
    keys under it, without it, and ignores the rest; when the keys do not fit and one such prefix
    would make them fit, the error names it.

    Example::

        >>> ddp_sd = {"module.weight": torch.zeros(2, 2), "module.bias": torch.zeros(2)}
        >>> list(dist_resume.adapt_state_dict(ddp_sd, torch.nn.Linear(2, 2)))
        ['weight', 'bias']
    """
    if key_prefix is not None:
        state_dict = select_prefix(state_dict, key_prefix)
    target_sd = model.state_dict(keep_vars=True)
    targets = model_key_map(model, target_sd.keys())
    pairs = match_keys(state_dict.keys(), targets)
    matched_targets = set(pairs.values())
    if len(matched_targets) < len(pairs):
        first: dict[str, str] = {}
        extra = []
        for src, dst in pairs.items():
            if dst in first:
                extra.append(src)
            first.setdefault(dst, src)
        clashes = preview((f"{first[pairs[k]]!r} and {k!r} -> {pairs[k]!r}" for k in extra), sep="; ", quote=False)
        raise KeyMismatchError(
            f"checkpoint keys are ambiguous ({len(extra)}): {clashes}; the state dict mixes wrapped and "
            "unwrapped forms of the same entries, keep one form (strip_prefix) and load again",
            unexpected=extra,
        )
    missing = [k for k in target_sd if k not in matched_targets]
    unexpected = [k for k in state_dict if k not in pairs]
    mismatched, not_tensors = [], []
    for src, dst in pairs.items():
        value, want = state_dict[src], target_sd[dst]
        if not isinstance(want, torch.Tensor):  # a module's extra state: whatever its set_extra_state takes
            continue
        kind = _kind_problem(value, want)
        if kind is not None:  # load_state_dict would copy the others first, then raise
            not_tensors.append(f"{dst}: checkpoint {kind}, model a {tuple(want.shape)} tensor")
        elif value.shape != want.shape:
            mismatched.append(f"{dst}: checkpoint {tuple(value.shape)}, model {tuple(want.shape)}")
    if mismatched or not_tensors or (strict and (missing or unexpected)):
        raise KeyMismatchError(
            _mismatch_message(state_dict.keys(), model, missing, unexpected, mismatched, strict, not_tensors),
            missing=missing,
            unexpected=unexpected,
            mismatched=not_tensors + mismatched,
        )
    out: OrderedDict[str, Any] = OrderedDict((pairs[k], state_dict[k]) for k in state_dict if k in pairs)
    _adapt_metadata(state_dict, pairs, out)
    return out


def _kind_problem(value: Any, want: torch.Tensor) -> str | None:
    """What ``value`` is when the model's dense ``want`` cannot take it (not a tensor, or a sparse, nested or
    quantized one: :func:`~dist_resume._core.tensor_kind.tensor_kind`), else None. A model whose own tensor is of
    such a kind (a quantized module) loads its own kind: that is its ``_load_from_state_dict``'s to check."""
    if not isinstance(value, torch.Tensor):
        return "None" if value is None else article(type(value).__name__)
    if tensor_kind(want) is not None:
        return None
    return tensor_kind(value)


def _mismatch_message(
    saved: Iterable[str],
    model: nn.Module,
    missing: list[str],
    unexpected: list[str],
    mismatched: list[str],
    strict: bool,
    not_tensors: list[str],
) -> str:
    lines = [
        f"checkpoint does not fit {type(unwrap_model(model)).__name__}"
        f" (key prefix in checkpoint: {prefix_style(saved)}; in model: {wrapper_prefix(model) or 'none'})"
    ]
    if missing:
        lines.append(f"  missing from checkpoint ({preview(missing, count=True)})")
    if unexpected:
        lines.append(f"  unexpected in checkpoint ({preview(unexpected, count=True)})")
    if mismatched:
        lines.append(f"  shape mismatch ({preview(mismatched, count=True)})")
    if not_tensors:
        lines.append(f"  not a dense tensor where the model has one ({preview(not_tensors, count=True)})")
    hint = "check that the checkpoint was saved from the same architecture and configuration"
    key_prefix = suggest_key_prefix(saved, unexpected, model) if missing and not mismatched else None
    if not_tensors:  # no state_dict() writes that: the file was damaged or edited
        hint = (
            "the checkpoint's model state is not one state_dict() writes (damaged or edited): resume from "
            "another checkpoint, or repair the entries named above"
        )
    elif key_prefix is not None:  # strict=False would load nothing here: say what does fit
        hint = (
            f"the model's keys sit under {key_prefix!r} in the checkpoint (e.g. a LightningModule's "
            f"attribute): pass key_prefix={key_prefix!r}"
        )
    elif strict and (missing or unexpected) and not mismatched:
        hint += (
            "; pass options=ResumeOptions(strict=False) to resume() (strict=False to adapt_state_dict) to load "
            "only the keys that fit"
        )
    lines.append(f"  what to do: {hint}")
    return "\n".join(lines)


def _adapt_metadata(state_dict: Mapping[str, Any], pairs: dict[str, str], out: OrderedDict[str, Any]) -> None:
    meta = getattr(state_dict, "_metadata", None)
    if meta is None:
        return
    # module paths follow the key pairing: "a.b.weight" -> "module.a.b.weight" maps "a.b" -> "module.a.b"
    paths = {src.rpartition(".")[0]: dst.rpartition(".")[0] for src, dst in pairs.items()}
    out._metadata = OrderedDict((paths[n], v) for n, v in meta.items() if n in paths)  # type: ignore[attr-defined]
