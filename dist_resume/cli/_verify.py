"""``dist-resume verify``: are two checkpoints the same training state, modulo ``module.``/``_orig_mod.`` prefixes?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.text import preview
from .._core.types import PathLike
from .._format.layout import CheckpointParts, split_checkpoint
from .._format.open import is_foreign_source, open_checkpoint
from .._format.sniff import FileKind, check_file, file_kind
from .._state.prefix import canonical_key, prefix_style
from ._common import SCHEMA_PREFIX

__all__ = ["verify_checkpoints", "render_verify", "same_bits"]

SCHEMA = f"{SCHEMA_PREFIX}/verify/1"
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


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


def _compare(a: Any, b: Any) -> str | None:
    """None when equal, else what differs."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape:
            return f"shape {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.dtype != b.dtype:
            return f"dtype {a.dtype} vs {b.dtype}"
        return None if same_bits(a, b) else "values differ"
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return f"{_describe(a)} vs {_describe(b)}"
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        if set(a) != set(b):
            return f"keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        return next((f"[{k!r}]: {d}" for k in a if (d := _compare(a[k], b[k]))), None)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return f"length {len(a)} vs {len(b)}"
        return next((f"[{i}]: {d}" for i, (x, y) in enumerate(zip(a, b)) if (d := _compare(x, y))), None)
    try:
        return None if bool(a == b) else f"{_describe(a)} vs {_describe(b)}"
    except Exception:  # objects whose == is not a plain bool
        return None if a is b else f"{_describe(a)} vs {_describe(b)}"


class _Report:
    def __init__(self) -> None:
        self.differences: list[dict[str, str]] = []
        self.tensors = {"model": 0, "optimizer": 0}
        self.bytes = 0

    def diff(self, part: str, key: str, problem: str) -> None:
        self.differences.append({"part": part, "key": key, "problem": problem})

    def compare(self, part: str, key: str, a: Any, b: Any) -> None:
        for value in (a,) if isinstance(a, torch.Tensor) else ():
            self.tensors[part] += 1
            self.bytes += value.numel() * value.element_size()
        problem = _compare(a, b)
        if problem:
            self.diff(part, key, problem)


def _canonical(model: Mapping[str, Any], which: str, report: _Report) -> dict[str, Any]:
    out: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for key, value in model.items():
        c = canonical_key(key)
        if c in out:
            report.diff("model", c, f"{which} holds it twice ({origin[c]!r} and {key!r})")
        out[c], origin[c] = value, key
    return out


def _compare_models(a: Mapping[str, Any], b: Mapping[str, Any], report: _Report) -> None:
    ca, cb = _canonical(a, "A", report), _canonical(b, "B", report)
    for key in ca.keys() - cb.keys():
        report.diff("model", key, "only in A")
    for key in cb.keys() - ca.keys():
        report.diff("model", key, "only in B")
    for key in ca:
        if key in cb:
            report.compare("model", key, ca[key], cb[key])


def _param_order(groups: list[Any]) -> list[tuple[str, Any]]:
    """(label, saved id) for every parameter, labelled by canonical name when every group has names."""
    named = all(isinstance(g, Mapping) and "param_names" in g for g in groups)
    out = []
    for gi, g in enumerate(groups):
        names = g.get("param_names") if named else None
        for j, pid in enumerate(g.get("params", [])):
            out.append((canonical_key(names[j]) if names else f"group {gi} param {j}", pid))
    return out


def _compare_optimizers(a: Any, b: Any, report: _Report) -> None:
    if a is None and b is None:
        return
    if a is None or b is None:
        report.diff("optimizer", "-", f"only in {'B' if a is None else 'A'}")
        return
    if not all(isinstance(o, Mapping) and "state" in o and "param_groups" in o for o in (a, b)):
        report.compare("optimizer", "-", a, b)
        return
    ga, gb = list(a["param_groups"]), list(b["param_groups"])
    if len(ga) != len(gb):
        report.diff("optimizer", "param_groups", f"{len(ga)} vs {len(gb)} groups")
        return
    for i, (x, y) in enumerate(zip(ga, gb)):
        hx = {k: v for k, v in x.items() if k not in ("params", "param_names")}
        hy = {k: v for k, v in y.items() if k not in ("params", "param_names")}
        report.compare("optimizer", f"param_groups[{i}]", hx, hy)
    pa, pb = dict(_param_order(ga)), dict(_param_order(gb))
    if set(pa) != set(pb):  # different names (or one side unnamed): pair by position instead
        if all(not k.startswith("group ") for k in (*pa, *pb)):
            only_a, only_b = sorted(set(pa) - set(pb)), sorted(set(pb) - set(pa))
            report.diff("optimizer", "param_names", f"only in A {only_a[:5]}, only in B {only_b[:5]}")
        pa = {f"param {n}": pid for n, (_, pid) in enumerate(_param_order(ga))}
        pb = {f"param {n}": pid for n, (_, pid) in enumerate(_param_order(gb))}
        if len(pa) != len(pb):
            report.diff("optimizer", "params", f"{len(pa)} vs {len(pb)} parameters")
            return
    for label, ida in pa.items():
        sa, sb = a["state"].get(ida), b["state"].get(pb[label])
        if sa is None or sb is None:
            if (sa is None) != (sb is None):
                report.diff("optimizer", f"state[{label}]", f"only in {'B' if sa is None else 'A'}")
            continue
        for key in sorted(set(sa) | set(sb), key=str):
            if key not in sa or key not in sb:
                report.diff("optimizer", f"state[{label}][{key!r}]", f"only in {'B' if key not in sa else 'A'}")
            else:
                report.compare("optimizer", f"state[{label}][{key!r}]", sa[key], sb[key])


def _load(path: PathLike) -> CheckpointParts:
    mmap = is_foreign_source(path) or file_kind(check_file(path)) is not FileKind.LEGACY
    opened = open_checkpoint(path, map_location="cpu", mmap=mmap, weights_only=True)  # foreign sources: parts
    return opened.parts or split_checkpoint(opened.obj, source=str(path))


def verify_checkpoints(a: PathLike, b: PathLike) -> dict[str, Any]:
    """The ``verify --json`` report: model and optimizer state of ``a`` and ``b``, compared modulo prefixes.

    Local. Both files are memory-mapped on the CPU; tensors are compared bitwise, a chunk at a time.
    """
    pa, pb = _load(a), _load(b)
    report = _Report()
    _compare_models(pa.model, pb.model, report)
    _compare_optimizers(pa.optimizer, pb.optimizer, report)
    return {
        "schema": SCHEMA,
        "a": {"path": str(a), "layout": pa.layout.value, "prefix_style": prefix_style(pa.model)},
        "b": {"path": str(b), "layout": pb.layout.value, "prefix_style": prefix_style(pb.model)},
        "equal": not report.differences,
        "compared": {
            "model_tensors": report.tensors["model"],
            "optimizer_tensors": report.tensors["optimizer"],
            "bytes": report.bytes,
        },
        "differences": report.differences,
    }


def render_verify(report: dict[str, Any], limit: int = 20) -> str:
    """The human-readable form of a :func:`verify_checkpoints` report."""
    c = report["compared"]
    head = (
        f"{c['model_tensors']} model and {c['optimizer_tensors']} optimizer tensors compared "
        f"(A: {report['a']['layout']}, prefix {report['a']['prefix_style']}; "
        f"B: {report['b']['layout']}, prefix {report['b']['prefix_style']})"
    )
    if report["equal"]:
        return f"equal: {head}"
    diffs = report["differences"]
    lines = [f"different: {len(diffs)} difference(s); {head}"]
    shown = preview((f"{d['part']} {d['key']}: {d['problem']}" for d in diffs), limit, sep="\n  ", quote=False)
    lines.append(f"  {shown}" + (" (--json lists all)" if len(diffs) > limit else ""))
    return "\n".join(lines)
