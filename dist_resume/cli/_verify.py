"""``dist-resume verify``: are two checkpoints the same training state, modulo ``module.``/``_orig_mod.`` prefixes?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._core.errors import UsageError
from .._core.text import preview
from .._core.types import PathLike
from .._format.sniff import FileKind, check_file, file_kind
from .._layout.detect import check_part_keys
from .._layout.layout import CheckpointParts, describe_keys, split_checkpoint
from .._source.open import open_checkpoint
from .._source.source import local_source
from .._state.optim_keys import GROUP_BOOKKEEPING
from .._state.prefix import canonical_key, prefix_style
from ._common import SCHEMA_PREFIX
from ._compare import compare_values, key_difference, max_abs_diff, same_bits

__all__ = ["verify_checkpoints", "render_verify", "same_bits", "max_abs_diff"]

SCHEMA = f"{SCHEMA_PREFIX}/verify/1"


class _Report:
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
    pids = [pid for g in groups for pid in g.get("params", [])]
    if named:
        names = [canonical_key(n) for g in groups for n in g["param_names"]]
        if len(names) == len(pids):
            return list(zip(names, pids))
    return [(f"param {n}", pid) for n, pid in enumerate(pids)]


def _compare_groups(ga: list[Any], gb: list[Any], report: _Report) -> None:
    for i, (x, y) in enumerate(zip(ga, gb)):
        hx = {k: v for k, v in x.items() if k not in GROUP_BOOKKEEPING}
        hy = {k: v for k, v in y.items() if k not in GROUP_BOOKKEEPING}
        if set(hx) != set(hy):
            report.diff("optimizer", f"group {i}", key_difference(hx, hy))
        for key in (k for k in hx if k in hy):
            report.compare("optimizer", f"group {i} {key}", hx[key], hy[key])


def _compare_optimizers(a: Any, b: Any, report: _Report) -> None:
    if a is None or b is None:
        if (a is None) != (b is None):
            report.not_compared.append(f"optimizer (only {'B' if a is None else 'A'} has one)")
        return
    if not all(isinstance(o, Mapping) and "state" in o and "param_groups" in o for o in (a, b)):
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


def _compare_rest(pa: CheckpointParts, pb: CheckpointParts, report: _Report) -> None:
    """Epoch, step, scheduler and GradScaler: compared where both files have them, else listed as not compared."""
    for part in ("epoch", "step", "scheduler", "scaler"):
        x, y = getattr(pa, part), getattr(pb, part)
        if x is not None and y is not None:
            report.compare(part, "-", x, y)
        elif (x is None) != (y is None):
            report.not_compared.append(f"{part} (only {'B' if x is None else 'A'} has one)")


def _keys_held(obj: Any, part_keys: Mapping[str, str] | None) -> dict[str, str] | None:
    """The entries of ``part_keys`` whose key ``obj`` holds (``verify --part`` names a key in either file)."""
    if not part_keys or not isinstance(obj, Mapping):
        return None
    out = {}
    for part, path in part_keys.items():
        outer, _, inner = path.partition(".")
        if path in obj or (inner and isinstance(obj.get(outer), Mapping) and inner in obj[outer]):
            out[part] = path
    return out or None


def _side(path: PathLike, parts: CheckpointParts) -> dict[str, Any]:
    return {
        "path": str(path),
        "layout": parts.layout.value,
        "prefix_style": prefix_style(parts.model),
        "part_keys": dict(parts.keys),
    }


def verify_checkpoints(a: PathLike, b: PathLike, *, part_keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``verify --json`` report: the parts detected in ``a`` and ``b``, compared modulo prefixes.

    Local. Model weights are compared under their canonical keys; the optimizer, epoch, step,
    scheduler and GradScaler where both files have them (a part only one file has is listed in
    ``not_compared``). ``part_keys`` (``verify --part``) names keys for parts in whichever file
    holds them. Both files are memory-mapped on the CPU; tensors are compared bitwise, a chunk at a time.
    """
    if part_keys:
        check_part_keys(part_keys)
    # foreign sources (HF Trainer, Accelerate, DCP, safetensors) come back already split into parts
    contents_a, contents_b = (open_checkpoint(p, map_location="cpu", mmap=_mmap(p), weights_only=True) for p in (a, b))
    obj_a, obj_b = contents_a.obj, contents_b.obj
    held_a, held_b = _keys_held(obj_a, part_keys), _keys_held(obj_b, part_keys)
    if part_keys:
        unused = [
            f"{part}={key}"
            for part, key in part_keys.items()
            if not (held_a or {}).get(part) and not (held_b or {}).get(part)
        ]
        if unused:
            raise UsageError(
                f"--part {preview(unused, quote=False)}: neither {str(a)!r} nor {str(b)!r} has that key",
                hint="run `dist-resume inspect` on each file to see its keys",
            )
    pa = contents_a.parts or split_checkpoint(obj_a, source=str(a), part_keys=held_a)
    pb = contents_b.parts or split_checkpoint(obj_b, source=str(b), part_keys=held_b)
    report = _Report()
    _compare_models(pa.model, pb.model, report)
    _compare_optimizers(pa.optimizer, pb.optimizer, report)
    _compare_rest(pa, pb, report)
    return {
        "schema": SCHEMA,
        "a": _side(a, pa),
        "b": _side(b, pb),
        "equal": not report.differences,
        "compared": {
            "model_tensors": report.tensors["model"],
            "optimizer_tensors": report.tensors["optimizer"],
            "bytes": report.bytes,
        },
        "not_compared": report.not_compared,
        "differences": report.differences,
    }


def _mmap(path: PathLike) -> bool:
    return local_source(path).layout is not None or file_kind(check_file(path)) is not FileKind.LEGACY


def _where(side: Mapping[str, Any]) -> str:
    keys = describe_keys(side.get("part_keys") or {})
    return f"{side['layout']}, prefix {side['prefix_style']}" + (f"; {keys}" if keys else "")


def render_verify(report: dict[str, Any], limit: int = 20) -> str:
    """The human-readable form of a :func:`verify_checkpoints` report."""
    c = report["compared"]
    optim = f" and {c['optimizer_tensors']} optimizer" if c["optimizer_tensors"] else ""
    head = f"{c['model_tensors']} model{optim} tensors compared"
    lines = []
    if report["equal"]:
        lines.append(f"equal: {head}")
    else:
        diffs = report["differences"]
        lines.append(f"different: {len(diffs)} difference{'s' if len(diffs) != 1 else ''}; {head}")
    lines.append(f"  A: {_where(report['a'])}")
    lines.append(f"  B: {_where(report['b'])}")
    if report.get("not_compared"):
        lines.append(f"  not compared: {', '.join(report['not_compared'])}")
    if not report["equal"]:
        diffs = report["differences"]
        shown = preview(
            (f"{d['part']}{'' if d['key'] == '-' else ' ' + d['key']}: {d['problem']}" for d in diffs),
            limit,
            sep="\n  ",
            quote=False,
        )
        lines.append(f"  {shown}" + (" (--json lists all)" if len(diffs) > limit else ""))
    return "\n".join(lines)
