"""The model part of a restore plan: the checkpoint's model state re-keyed to the live model, or why it does not fit."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

from torch import nn

from ..._core.errors import KeyMismatchError
from ..._core.text import preview
from ..._state.adapt import adapt_state_dict
from ..._state.prefix import match_keys, model_key_map, unwrap_model
from ..._state.subtree import suggest_key_prefix
from ..._state.validate import check_dtypes

__all__ = ["plan_model"]


def plan_model(
    saved: Mapping[str, Any], model: nn.Module, strict: bool, hint_prefix: bool, source: str
) -> tuple[OrderedDict[str, Any], list[str], list[str]]:
    """The model state re-keyed to ``model``'s form, the live keys it lacks and the saved keys it drops.

    Raises :class:`KeyMismatchError` when it does not fit, and also under ``strict=False`` when nothing fits;
    with ``hint_prefix`` the message names the ``key_prefix=`` that would make it fit, where one would.
    """
    try:
        adapted = adapt_state_dict(saved, model, strict=strict)
    except KeyMismatchError as err:  # say which file, and which key_prefix would fit
        message = str(err)
        hint = suggest_key_prefix(saved.keys(), err.unexpected, model) if hint_prefix and not err.mismatched else None
        nothing_fits = not err.mismatched and len(err.missing) == len(model.state_dict())
        if hint is not None or nothing_fits:  # strict=False would load nothing: do not suggest it
            advice = _prefix_advice(hint) if hint is not None else _NOTHING_FITS
            message = message.rsplit("\n  what to do:", 1)[0] + f"\n  what to do: {advice}"
        raise KeyMismatchError(
            f"{source}: {message}", missing=err.missing, unexpected=err.unexpected, mismatched=err.mismatched
        ) from err
    live_keys = list(model.state_dict().keys())
    missing = [k for k in live_keys if k not in adapted]
    unexpected: list[str] = []
    if len(adapted) < len(saved):  # saved keys are in the file's form: compare through the pairing
        paired = match_keys(saved.keys(), model_key_map(model))
        unexpected = [k for k in saved if k not in paired]
    if not adapted and live_keys:
        hint = suggest_key_prefix(saved.keys(), unexpected, model) if hint_prefix else None
        raise KeyMismatchError(
            f"{source}: nothing in the checkpoint fits {type(unwrap_model(model)).__name__}: 0 of "
            f"{len(live_keys)} model keys found (missing {preview(missing, count=True)}; unexpected "
            f"{preview(unexpected, count=True)}); " + (_prefix_advice(hint) if hint else _NOTHING_FITS),
            missing=missing,
            unexpected=unexpected,
        )
    check_dtypes(adapted, model, strict, source)
    return adapted, missing, unexpected


_NOTHING_FITS: Final = (
    "no key of the checkpoint fits the model (strict=False would load nothing); check that it was saved from "
    "this architecture, or name its model entry with part_keys= / its sub-tree with key_prefix="
)


def _prefix_advice(prefix: str) -> str:
    return f"the checkpoint's model keys sit under {prefix!r}: pass key_prefix={prefix!r} to load that sub-tree"
