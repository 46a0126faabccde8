"""EMA weights: ``torch.optim.swa_utils.AveragedModel`` (its module plus ``n_averaged``) or any ``nn.Module``.

In a dist_resume file the EMA entry holds the averaged module's canonical state (no ``module.``/``_orig_mod.``
prefixes, not even AveragedModel's own ``module.``) plus ``n_averaged`` when there is one, so it resumes into
a plain module, an AveragedModel of a plain or of a DDP model alike.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

from ..._core.errors import KeyMismatchError
from ..._core.text import article
from ..._state.adapt import adapt_state_dict
from ..._state.prefix import add_prefix, canonical_state_dict
from ..._state.validate import check_dtypes

__all__ = ["N_AVERAGED", "canonical_ema_state", "adapt_ema_state", "ema_key_count"]

N_AVERAGED: Final = "n_averaged"  # AveragedModel's buffer: how many models were averaged so far


def _averaged(ema: nn.Module) -> nn.Module:
    """The module whose weights ``ema`` averages (``ema`` itself unless it is an AveragedModel)."""
    return ema.module if isinstance(ema, AveragedModel) else ema


def canonical_ema_state(ema: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """The EMA entry a dist_resume file stores: canonical keys of the averaged module, plus ``n_averaged``."""
    out = canonical_state_dict(_averaged(ema))
    if isinstance(ema, AveragedModel):
        out[N_AVERAGED] = ema.n_averaged
    return out


def adapt_ema_state(saved: Any, ema: nn.Module, *, strict: bool, source: str) -> OrderedDict[str, Any]:
    """The saved EMA state re-keyed to ``ema.state_dict()``'s form (validated; nothing changes).

    Accepts this toolkit's entry, an AveragedModel's own state dict (``module.*`` + ``n_averaged``) and a
    plain module state dict with any wrapper prefixes. ``n_averaged`` saved for a live module that is not an
    AveragedModel is dropped; an AveragedModel restored from a file without it keeps its own (missing under
    ``strict``).
    """
    if not isinstance(saved, Mapping):
        raise KeyMismatchError(f"{source}: the EMA entry is {article(type(saved).__name__)}, not a state dict")
    weights = OrderedDict((k, v) for k, v in saved.items() if k != N_AVERAGED)
    meta = getattr(saved, "_metadata", None)
    if meta is not None:
        weights._metadata = meta  # type: ignore[attr-defined]
    inner = _averaged(ema)
    try:
        adapted = adapt_state_dict(weights, inner, strict=strict)
    except KeyMismatchError as err:
        raise KeyMismatchError(
            f"{source}: EMA state: {err}", missing=err.missing, unexpected=err.unexpected, mismatched=err.mismatched
        ) from err
    check_dtypes(adapted, inner, strict, f"{source} (EMA)")
    if not isinstance(ema, AveragedModel):
        return adapted
    out = add_prefix(adapted, "module.")  # AveragedModel keeps the averaged module as ``self.module``
    if N_AVERAGED in saved:
        out[N_AVERAGED] = _n_averaged(saved[N_AVERAGED], ema.n_averaged, source)
    elif strict:
        raise KeyMismatchError(
            f"{source}: the EMA state has no {N_AVERAGED!r} but the EMA is an AveragedModel; pass "
            f"options=ResumeOptions(strict=False) to keep its own {N_AVERAGED}",
            missing=[N_AVERAGED],
        )
    return out


def _n_averaged(value: Any, live: torch.Tensor, source: str) -> torch.Tensor:
    """The saved ``n_averaged``, refused unless ``load_state_dict`` can copy it into the live one."""
    if not isinstance(value, torch.Tensor) or value.shape != live.shape or value.is_complex():
        found = f"a {tuple(value.shape)} {value.dtype} tensor" if isinstance(value, torch.Tensor) else repr(value)[:40]
        raise KeyMismatchError(
            f"{source}: the EMA's {N_AVERAGED!r} is {found}, not the {tuple(live.shape)} count AveragedModel keeps; "
            "the checkpoint is damaged or was edited: resume from another checkpoint, or without ema=",
            mismatched=[N_AVERAGED],
        )
    return value


def ema_key_count(ema: nn.Module) -> int:
    """How many entries ``ema.state_dict()`` has (the total that ``applied['ema']`` counts against)."""
    return len(ema.state_dict())
