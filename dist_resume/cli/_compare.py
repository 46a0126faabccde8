"""How ``dist-resume verify`` compares two values: bitwise tensor equality, ``max |a-b|``, and the words for a difference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.text import preview, shown

__all__ = ["same_bits", "max_abs_diff", "compare_values", "key_difference"]

_CHUNK: Final = 64 << 20  # bytes compared at a time: memory-mapped pages come and go, nothing is copied


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    t = t.resolve_conj().resolve_neg().contiguous()  # no copy for the contiguous tensors checkpoints hold
    return t.reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN equals NaN, 0.0 differs from -0.0), compared in chunks."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    if a.layout != torch.strided or a.is_quantized or b.layout != torch.strided or b.is_quantized:
        return bool(torch.equal(a, b))
    x, y = _bytes_of(a), _bytes_of(b)
    return all(torch.equal(x[i : i + _CHUNK], y[i : i + _CHUNK]) for i in range(0, x.numel(), _CHUNK))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest ``|a - b|`` of two same-shape tensors (NaN where both are NaN counts as equal), in chunks.

    None for tensors without a numeric difference (quantized, sparse, other layouts).
    """
    if a.layout != torch.strided or a.is_quantized or b.layout != torch.strided or b.is_quantized:
        return None
    x, y = a.resolve_conj().resolve_neg().reshape(-1), b.resolve_conj().resolve_neg().reshape(-1)
    step = max(_CHUNK // 16, 1)
    worst = 0.0
    for i in range(0, x.numel(), step):
        xa, yb = x[i : i + step], y[i : i + step]
        wide = torch.complex128 if xa.is_complex() or yb.is_complex() else torch.float64
        d = (xa.to(wide) - yb.to(wide)).abs()
        both_nan = torch.isnan(xa.to(wide)).logical_and(torch.isnan(yb.to(wide)))
        d = d.masked_fill(both_nan, 0.0)
        if bool(torch.isnan(d).any()):
            return float("nan")
        worst = max(worst, float(d.max()) if d.numel() else 0.0)
    return worst


def _values_differ(a: torch.Tensor, b: torch.Tensor) -> str:
    diff = max_abs_diff(a, b)
    if diff is None:
        return "values differ"
    if diff != diff:  # NaN
        return "values differ (NaN in one file where the other has a number)"
    if diff == 0.0:
        return "values differ in their bits only (0.0 vs -0.0, or NaN payloads)"
    return f"values differ (max |a-b| = {diff:.1e})"


def key_difference(a: Mapping[Any, Any], b: Mapping[Any, Any]) -> str:
    """``B has `initial_lr`, A does not``, for keys on either side (or both)."""
    said = []
    for side, mine, other, theirs in (("A", a, "B", b), ("B", b, "A", a)):
        extra = [k for k in mine if k not in theirs]
        if extra:
            keys = preview((f"`{k}`" for k in extra), 5, quote=False)
            said.append(f"{side} has {keys}, {other} does not")
    return "; ".join(said)


def _describe_dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{tuple(value.shape)}"
    return f"{type(value).__name__} {shown(value)}"[:80]


def compare_values(a: Any, b: Any) -> str | None:
    """None when equal, else what differs."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} in A, {tuple(b.shape)} in B"
        if a.dtype != b.dtype:
            return f"dtype {_describe_dtype(a)} in A, {_describe_dtype(b)} in B"
        return None if same_bits(a, b) else _values_differ(a, b)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"A {_describe(a)}, B {_describe(b)}"
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return key_difference(a, b)
        return next((f"[{k!r}]: {d}" for k in a if (d := compare_values(a[k], b[k]))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"A has {len(a)} items, B {len(b)}"
        return next((f"[{i}]: {d}" for i, (x, y) in enumerate(zip(a, b)) if (d := compare_values(x, y))), None)
    if isinstance(a, float) and isinstance(b, float) and a != b and shown(a) == shown(b):
        return f"A float {a!r}, B float {b!r} (|a-b| = {abs(a - b):.3g})"  # equal to 6 digits: show them all
    try:
        return None if bool(a == b) else f"A {_describe(a)}, B {_describe(b)}"
    except Exception:  # objects whose == is not a plain bool
        return None if a is b else f"A {_describe(a)}, B {_describe(b)}"
