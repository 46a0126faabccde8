"""How ``dist-resume verify`` compares two checkpoints' parts (models under canonical keys, optimizers by parameter,
the rest where both have it) and two values: bitwise tensor equality, ``max |a-b|``, and the words for a difference."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.strides import overlapping
from .._core.tensor_kind import tensor_kind
from .._core.text import preview, shown
from .._layout.layout import CheckpointParts
from .._state.optim.keys import GROUP_BOOKKEEPING, optimizer_form_problem
from .._state.prefix import canonical_key

__all__ = ["same_bits", "max_abs_diff", "compare_values", "key_difference", "compare_parts"]

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
        return _compare_tensors(a, b)
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


def _compare_tensors(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None when equal, else what differs: the kinds (dense, sparse, nested, quantized, meta), shape, dtype, values."""
    kind_a, kind_b = tensor_kind(a, stand_ins=False), tensor_kind(b, stand_ins=False)
    if kind_a != kind_b:
        return f"A {kind_a or 'a dense tensor'}, B {kind_b or 'a dense tensor'}"
    if a.is_nested:  # no one shape: its tensors, one by one
        return compare_values(list(a.unbind()), list(b.unbind()))
    if a.shape != b.shape:
        return f"shape {tuple(a.shape)} in A, {tuple(b.shape)} in B"
    if a.dtype != b.dtype:
        return f"dtype {_describe_dtype(a)} in A, {_describe_dtype(b)} in B"
    if a.is_meta:  # no data on either side: the shape and dtype are all there is
        return None
    if a.layout != torch.strided:  # sparse: the values it stands for
        return compare_values(a.to_dense(), b.to_dense())
    if kind_a is not None:  # expanded: its stored elements, never the logical ones (a few bytes can stand for 10**8)
        a, b = _stored(a), _stored(b)
        if a.shape != b.shape or overlapping(a.shape, a.stride()) or overlapping(b.shape, b.stride()):
            return "A and B are expanded differently: values not compared"
    return None if same_bits(a, b) else _values_differ(a, b)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each dimension of stride 0 cut to one element: the values an expanded tensor is made of (a copy, as
    many elements as it stores at most)."""
    kept = t[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in t.stride())]
    return torch.empty_like(kept, memory_format=torch.contiguous_format).copy_(kept)


class Report:
    def __init__(self) -> None:
        self.differences: list[dict[str, str]] = []
        self.tensors = {"model": 0, "optimizer": 0, "other": 0}
        self.not_compared: list[str] = []
        self.bytes = 0

    def diff(self, part: str, key: str, problem: str) -> None:
        self.differences.append({"part": part, "key": key, "problem": problem})

    def compare(self, part: str, key: str, a: Any, b: Any) -> None:
        for value in (a,) if isinstance(a, torch.Tensor) else ():
            self.tensors[part if part in self.tensors else "other"] += 1
            self.bytes += value.numel() * value.element_size()
        problem = compare_values(a, b)
        if problem:
            self.diff(part, key, problem)


def _canonical(model: Mapping[str, Any], which: str, report: Report) -> dict[str, Any]:
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in model.items():
        c = canonical_key(key)
        if c in out:
            report.diff("model", c, f"{which} holds it twice ({origin[c]!r} and {key!r})")
        out[c], origin[c] = value, key
    return out


def _compare_models(a: Mapping[str, Any], b: Mapping[str, Any], report: Report) -> None:
    ca, cb = _canonical(a, "A", report), _canonical(b, "B", report)
    for key in sorted(ca.keys() - cb.keys()):
        report.diff("model", key, "A has it, B does not")
    for key in sorted(cb.keys() - ca.keys()):
        report.diff("model", key, "B has it, A does not")
    for key in ca:
        if key in cb:
            report.compare("model", key, ca[key], cb[key])


def _param_order(groups: list[Any]) -> list[tuple[str, Any]]:
    """(label, saved id) for every parameter: its canonical name when every group has names, else ``param N``."""
    named = all(isinstance(g, Mapping) and "param_names" in g for g in groups)
    pids = [pid for g in groups for pid in g["params"]]
    if named:
        names = [canonical_key(n) for g in groups for n in g["param_names"]]
        if len(names) == len(pids):
            return list(zip(names, pids))
    return [(f"param {n}", pid) for n, pid in enumerate(pids)]


def _compare_groups(ga: list[Any], gb: list[Any], report: Report) -> None:
    for i, (x, y) in enumerate(zip(ga, gb)):
        hx = {k: v for k, v in x.items() if k not in GROUP_BOOKKEEPING}
        hy = {k: v for k, v in y.items() if k not in GROUP_BOOKKEEPING}
        if set(hx) != set(hy):
            report.diff("optimizer", f"group {i}", key_difference(hx, hy))
        for key in (k for k in hx if k in hy):
            report.compare("optimizer", f"group {i} {key}", hx[key], hy[key])


def _compare_optimizers(a: Any, b: Any, report: Report) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            report.not_compared.append(f"optimizer (only {'B' if a is None else 'A'} has one)")
        return
    if optimizer_form_problem(a) or optimizer_form_problem(b):  # not Optimizer.state_dict()'s form: as plain values
        report.compare("optimizer", "-", a, b)
        return
    ga, gb = list(a["param_groups"]), list(b["param_groups"])
    if len(ga) != len(gb):
        report.diff("optimizer", "param_groups", f"A has {len(ga)} groups, B {len(gb)}")
        return
    _compare_groups(ga, gb, report)
    pa, pb = dict(_param_order(ga)), dict(_param_order(gb))
    if set(pa) != set(pb):  # different names (or one side unnamed): pair by position instead
        if not any(k.startswith("param ") for k in (*pa, *pb)):
            for name in sorted(set(pa) - set(pb)):
                report.diff("optimizer", name, "A's optimizer has this parameter, B's does not")
            for name in sorted(set(pb) - set(pa)):
                report.diff("optimizer", name, "B's optimizer has this parameter, A's does not")
        oa, ob = _param_order(ga), _param_order(gb)
        named = next((o for o in (oa, ob) if not any(k.startswith("param ") for k, _ in o)), None)
        unnamed_side = any(k.startswith("param ") for k, _ in (*oa, *ob))
        # one naming scheme: the names of the side that has them, where the other side pairs by position
        labels = [k for k, _ in named] if named is not None and unnamed_side and len(oa) == len(ob) else None
        pa = {(labels[n] if labels else f"param {n}"): pid for n, (_, pid) in enumerate(oa)}
        pb = {(labels[n] if labels else f"param {n}"): pid for n, (_, pid) in enumerate(ob)}
        if len(pa) != len(pb):
            report.diff("optimizer", "params", f"A has {len(pa)} parameters, B {len(pb)}")
            return
    for label, ida in pa.items():
        sa, sb = a["state"].get(ida), b["state"].get(pb[label])
        if sa is None or sb is None:
            if (sa is None) != (sb is None):
                report.diff("optimizer", label, f"{'A' if sb is None else 'B'} has state for it, the other does not")
            continue
        if set(sa) != set(sb):
            report.diff("optimizer", label, key_difference(sa, sb))
        for key in sorted((k for k in sa if k in sb), key=str):
            report.compare("optimizer", f"{label} {key}", sa[key], sb[key])


def _compare_rest(pa: CheckpointParts, pb: CheckpointParts, report: Report) -> None:
    """Epoch, step, scheduler and GradScaler: compared where both files have them, else listed as not compared."""
    for part in ("epoch", "step", "scheduler", "scaler"):
        x, y = getattr(pa, part), getattr(pb, part)
        if x is not None and y is not None:
            report.compare(part, "-", x, y)
        elif (x is None) != (y is None):
            report.not_compared.append(f"{part} (only {'B' if x is None else 'A'} has one)")


def compare_parts(pa: CheckpointParts, pb: CheckpointParts) -> Report:
    """Every difference between two checkpoints' parts, and what was compared. Local."""
    report = Report()
    _compare_models(pa.model, pb.model, report)
    _compare_optimizers(pa.optimizer, pb.optimizer, report)
    _compare_rest(pa, pb, report)
    return report
