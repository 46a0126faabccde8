"""The words of ``dist-resume inspect``: one renderer for the report of every kind of source."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._core.text import preview, shown
from ..._layout.layout import describe_keys
from .._common import human_bytes

__all__ = ["render_inspect"]

_META_SHOWN = ("step", "epoch", "epoch_float", "world_size", "torch_version", "format_version", "dist_resume_version")


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def _group_line(i: int, group: Mapping[str, Any]) -> str:
    values = " ".join(
        f"{k}={shown(v) if isinstance(v, (float, tuple)) else v}" for k, v in group.items() if v is not None
    )
    return f"             group {i}: {values or '-'}"


def _kind(opt: Mapping[str, Any]) -> str:
    """``AdamW`` when the class was saved; a guess from the hyper-parameters says that it is one."""
    if opt.get("kind") is None:
        return "unknown kind"
    if opt.get("kind_from") == "hyperparameters":  # flags (amsgrad=False, foreach=None) say little: left out
        hyper = opt.get("hyperparameters", {})
        names = ", ".join(k for k, v in hyper.items() if k != "lr" and not isinstance(v, bool) and v is not None)
        return f"unknown class ({opt['kind']}-like: {names or 'lr'})"
    return str(opt["kind"])


def _optimizer_lines(opt: Mapping[str, Any]) -> list[str]:
    lines = [
        f"optimizer    {_kind(opt)}: {opt['param_groups']} group(s), "
        f"{opt['params']} params ({opt['params_with_state']} with state), "
        f"state keys: {', '.join(opt['state_keys']) or 'none'}"
    ]
    step = opt["step"]
    if step["count"]:
        where = step["where"]
        if list(where) == ["python number"]:
            lines.append(f"             step values: {step['count']} (python numbers, one per parameter)")
        else:
            places = ", ".join(w if len(where) == 1 else f"{n} {w}" for w, n in where.items())
            lines.append(f"             step tensors: {step['count']} ({places}), one per parameter")
    names = opt["param_names"]
    form = f"prefix {names['prefix_style']}" if names["present"] else "absent"
    lines.append(f"             param_names: {form}")
    lines.extend(_group_line(i, g) for i, g in enumerate(opt.get("groups", [])))
    return lines


def _source_lines(report: Mapping[str, Any]) -> list[str]:
    archive = report.get("archive")
    if archive is not None:
        return [
            f"checkpoint   {report['path']}  ({human_bytes(report['file_bytes'])}, "
            f"data.pkl {human_bytes(archive['pickle_bytes'])})"
        ]
    files = report.get("files") or []
    lines = [f"checkpoint   {report['path']}  ({human_bytes(report['file_bytes'])}, {len(files)} file(s))"]
    listed = [f"{f['name']} ({human_bytes(f['size'])})" for f in files]
    lines.append(f"files        {preview(listed, 12, quote=False) or '-'}")
    for entry in report.get("not_read") or []:
        lines.append(f"not read     {entry['name']}: {entry['why']}")
    return lines


def _sharded_lines(sharded: Mapping[str, Any]) -> list[str]:
    """A sharded checkpoint folder: the world size and mesh it was written at, each rank's files, completeness."""
    shape, dims = sharded["mesh_shape"], sharded["mesh_dim_names"]
    if shape is None:
        mesh = "no device mesh (written from full tensors by convert; loads at any world size)"
    else:
        named = f" ({', '.join(dims)})" if dims else ""
        mesh = f"mesh {' x '.join(map(str, shape))}{named}"
    lines = [
        f"sharded      written at world size {sharded['world_size']}, {mesh}; {sharded['writers']} writing rank(s), "
        f"{sharded['shard_files']} shard file(s); holds {', '.join(sharded['contents']) or 'nothing'}"
    ]
    ranks = [f"rank {r['rank']}: {', '.join(r['files'])} ({human_bytes(r['bytes'])})" for r in sharded["ranks"]]
    lines.append(f"shards       {preview(ranks, 8, sep='; ', quote=False)}")
    lines.append(f"complete     yes: {sharded['checked']}")
    return lines


def render_inspect(report: dict[str, Any]) -> str:
    """The human-readable form of a :func:`~dist_resume.cli.inspect._report.describe_checkpoint` report. Local."""
    model, opt, meta = report["model"], report["optimizer"], report["meta"]
    lines = _source_lines(report)
    lines.append(f"layout       {report['layout'] or 'not recognised'}")
    if report.get("sharded"):
        lines.extend(_sharded_lines(report["sharded"]))
    if report.get("part_keys"):
        lines.append(f"parts        {describe_keys(report['part_keys'])}")
    if report.get("saved_at"):
        lines.append(f"saved        {report['saved_at']}")
    if model is not None:
        kind = f"{model['class']}: " if model.get("class") else ""
        lines.append(
            f"model        {kind}{model['keys']} keys, {model['tensors']} tensors, {human_bytes(model['bytes'])}, "
            f"prefix: {model['prefix_style']}"
            + (
                f"; every key under {model['key_prefix']!r}: key_prefix={model['key_prefix']!r} loads the inner module"
                if model.get("key_prefix")
                else ""
            )
        )
    if report["layout"] is not None:
        if opt is None:
            lines.append("optimizer    none")
        elif opt.get("kind") is not None or "params" in opt:
            lines.extend(_optimizer_lines(opt))
        ema = report.get("ema")
        lines.append(
            f"state        scheduler: {_yes(report['scheduler'])}, GradScaler: {_yes(report['scaler'])}, "
            f"RNG: {_yes(report.get('rng'))}, sampler: {_yes(report.get('sampler'))}, "
            f"EMA: {_yes(ema)}" + (f" ({ema['keys']} keys)" if ema and ema.get("keys") is not None else "")
        )
    tensors = report["tensors"]
    dtypes = ", ".join(f"{d} {human_bytes(v['bytes'])} ({v['count']})" for d, v in tensors["by_dtype"].items())
    lines.append(f"tensors      {tensors['count']}, {human_bytes(tensors['bytes'])}: {dtypes or '-'}")
    if report.get("tensor_data") and report.get("archive") is None:
        lines.append(f"tensor data  {report['tensor_data']}")
    tags = ", ".join(
        f"{t} ({v['storages']} storages, {human_bytes(v['bytes'])})" for t, v in report["device_tags"].items()
    )
    lines.append(f"device tags  {tags or '-'}")
    shown = {k: meta[k] for k in _META_SHOWN if meta.get(k) is not None}
    if shown.get("epoch_float") == shown.get("epoch"):  # HF counts fractional epochs; a whole one is said once
        shown.pop("epoch_float", None)
    lines.append("meta         " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "-"))
    used = set(report.get("part_keys", {}).values())
    others = [k for k in report["extra_keys"] if k not in used]
    if others:
        lines.append(f"other keys   {preview(others, 10, quote=False)}")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
