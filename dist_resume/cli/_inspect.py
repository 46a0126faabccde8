"""``dist-resume inspect``: what a checkpoint holds, read from its pickle alone (no tensor data is loaded)."""

from __future__ import annotations

import datetime
import functools
import zipfile
import zlib
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from .._core.errors import CheckpointCorruptError, NotACheckpointError, UsageError
from .._core.text import preview
from .._core.tree import iter_tensors
from .._core.types import PathLike
from .._format.archive import ArchiveContents, StorageInfo, read_archive
from .._format.layout import Key, Layout, describe_keys, split_checkpoint
from .._state.optim import _FACTORED_KEYS, _GROUP_BOOKKEEPING, step_on_param_device
from .._state.prefix import canonical_key, prefix_style
from ._common import SCHEMA_PREFIX, dtype_name, human_bytes, jsonable

__all__ = ["describe_checkpoint", "render_inspect", "optimizer_kind"]

SCHEMA = f"{SCHEMA_PREFIX}/inspect/1"
_NOT_HYPERPARAMETERS = _GROUP_BOOKKEEPING | {"max_lr", "min_lr", "max_momentum", "base_momentum"}


def _summary(contents: ArchiveContents, obj: Any) -> dict[str, Any]:
    """Tensor count and bytes (each storage counted once), per dtype."""
    count: Counter[str] = Counter()
    storages: dict[str, StorageInfo] = {}
    for t in iter_tensors(obj):
        count[dtype_name(t.dtype)] += 1
        info = contents.storage_of(t)
        if info is not None:
            storages[info.key] = info
    nbytes: Counter[str] = Counter()
    for info in storages.values():
        nbytes[dtype_name(info.dtype)] += info.nbytes
    by_dtype = {d: {"count": count[d], "bytes": nbytes[d]} for d in sorted(count | nbytes)}
    return {"count": sum(count.values()), "bytes": sum(nbytes.values()), "by_dtype": by_dtype}


@functools.lru_cache(maxsize=1)
def _optimizer_signatures() -> dict[str, tuple[frozenset[str], Any]]:
    """Each ``torch.optim`` class's hyper-parameter names (and decoupled_weight_decay), from a live instance."""
    out = {}
    for name in sorted(dir(torch.optim)):
        cls: Any = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            make: Any = cls
            try:
                opt = make([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.01)
            except Exception:  # optimizers with required arguments or constraints: not recognisable
                continue
            out[name] = (frozenset(opt.defaults), opt.defaults.get("decoupled_weight_decay"))
    return out


def optimizer_kind(groups: list[Any]) -> str | None:
    """The ``torch.optim`` class whose hyper-parameters the saved param groups carry, or None."""
    if not groups or not isinstance(groups[0], Mapping):
        return None
    keys = frozenset(groups[0]) - _NOT_HYPERPARAMETERS
    best: list[tuple[int, int, str]] = []
    for name, (known, decoupled) in _optimizer_signatures().items():
        if decoupled is not None and groups[0].get("decoupled_weight_decay", decoupled) != decoupled:
            continue
        if keys - known - {"momentum", "betas", "initial_lr"}:
            continue  # the group has hyper-parameters this class does not use (schedulers may add momentum/betas)
        best.append((len(known - keys), len(keys - known), name))
    return min(best)[2] if best else None


def _optimizer(
    contents: ArchiveContents, opt: Any, model: Mapping[str, Any], meta: Mapping[str, Any], warnings: list[str]
) -> dict[str, Any] | None:
    if opt is None:
        return None
    if not (
        isinstance(opt, Mapping)
        and isinstance(opt.get("state"), Mapping)
        and isinstance(opt.get("param_groups"), (list, tuple))
    ):
        warnings.append("the optimizer entry is not an optimizer state dict (no 'state' / 'param_groups')")
        return {"kind": None}
    groups, state = list(opt["param_groups"]), opt["state"]
    names = [n for g in groups for n in (g.get("param_names") or [])] if all("param_names" in g for g in groups) else []
    ids = [i for g in groups for i in g.get("params", [])]
    where: Counter[str] = Counter()
    step_dtypes: Counter[str] = Counter()
    on_device_policy = any(step_on_param_device(g) for g in groups)
    keys: set[str] = set()
    for per_param in state.values():
        keys.update(per_param)
        step = per_param.get("step")
        if isinstance(step, torch.Tensor):
            info = contents.storage_of(step)
            where[info.location if info else "meta"] += 1
            step_dtypes[dtype_name(step.dtype)] += 1
        elif step is not None:
            where["python number"] += 1
    gpu_steps = sorted(k for k in where if k.startswith("cuda"))
    if gpu_steps and not on_device_policy:
        warnings.append(
            f"optimizer 'step' tensors are on {', '.join(gpu_steps)} though no group is fused or "
            "capturable: torch keeps them on the CPU (a GPU step forces a host sync per parameter "
            "per step); "
            "dist_resume.optimizer_to() puts them back"
        )
    _shape_warnings(state, ids, names, model, warnings)
    if names and prefix_style(names) != prefix_style(model):
        warnings.append(f"optimizer param_names use prefix {prefix_style(names)!r}, model keys {prefix_style(model)!r}")
    summary = _summary(contents, opt)
    return {
        "kind": meta.get("optimizer_class") or optimizer_kind(groups),
        "param_groups": len(groups),
        "params": len(ids),
        "params_with_state": len(state),
        "state_keys": sorted(keys),
        "step": {"count": sum(where.values()), "where": dict(where), "dtypes": dict(step_dtypes)},
        "param_names": {"present": bool(names), "prefix_style": prefix_style(names) if names else None},
        "hyperparameters": {k: jsonable(v) for k, v in groups[0].items() if k not in _GROUP_BOOKKEEPING}
        if groups
        else {},
        "groups": [
            {k: jsonable(v) for k, v in g.items() if k not in ("params", "param_names")}
            if isinstance(g, Mapping)
            else {}
            for g in groups
        ],
        "tensors": summary["count"],
        "bytes": summary["bytes"],
    }


def _shape_warnings(
    state: Mapping[Any, Any], ids: list[Any], names: list[str], model: Mapping[str, Any], warnings: list[str]
) -> None:
    shapes = {canonical_key(k): tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    all_shapes = set(shapes.values())
    by_id = dict(zip(ids, names)) if len(names) == len(ids) else {}
    problems = []
    for pid, per_param in state.items():
        name = by_id.get(pid)
        want = shapes.get(canonical_key(name)) if name else None
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor) or key == "step" or value.dim() == 0 or key in _FACTORED_KEYS:
                continue
            shape = tuple(value.shape)
            if want is not None and shape != want:
                problems.append(f"state[{name!r}][{key!r}] is {shape}, the parameter {want}")
            elif want is None and shape not in all_shapes:
                problems.append(f"state[{name or pid!r}][{key!r}] is {shape}, which no model tensor has")
    if problems:
        warnings.append(
            "optimizer state does not fit the model's parameters: "
            + preview(problems, 3, sep="; ", quote=False)
            + " (it would be paired with the wrong parameters or fail at the first step)"
        )


def _archive_info(contents: ArchiveContents) -> dict[str, Any]:
    small = {}
    try:
        with zipfile.ZipFile(contents.path) as zf:
            for name in (".format_version", ".storage_alignment", "byteorder", "version"):
                full = f"{contents.archive_name}/{name}"
                if any(r.name == full for r in contents.records):
                    small[name] = zf.read(full).decode("utf-8", "replace").strip()
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError, NotImplementedError, ValueError) as err:
        raise CheckpointCorruptError(
            f"checkpoint {str(contents.path)!r} is damaged: a small record of its archive cannot be read "
            f"({type(err).__name__}: {str(err)[:200]}); run `dist-resume verify` on it and resume from an "
            "earlier checkpoint"
        ) from err
    return {
        "name": contents.archive_name,
        "records": len(contents.records),
        "pickle_bytes": contents.pickle_size,
        "version": small.get("version"),
        "format_version": small.get(".format_version"),
        "storage_alignment": small.get(".storage_alignment"),
        "byteorder": small.get("byteorder"),
    }


def _device_tags(contents: ArchiveContents) -> dict[str, dict[str, int]]:
    tags: dict[str, dict[str, int]] = {}
    for info in contents.storages.values():
        entry = tags.setdefault(info.location, {"storages": 0, "bytes": 0})
        entry["storages"] += 1
        entry["bytes"] += info.nbytes
    return tags


def _saved_at(meta: Mapping[str, Any]) -> str | None:
    """``meta['saved_at']`` (seconds since the epoch) as ``2025-01-02 03:04:05 UTC``, or None."""
    stamp = meta.get("saved_at")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        return None
    try:
        return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return None


def _ema(ema: Any) -> dict[str, Any] | None:
    if ema is None:
        return None
    return {"keys": len(ema) if isinstance(ema, Mapping) else None}


def describe_checkpoint(path: PathLike, *, part_keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``inspect --json`` report for ``path``. Local; reads the zip directory and data.pkl only.

    A file in no layout dist_resume knows is still described (tensors, device tags), with
    ``layout`` ``null`` and a warning saying why. ``part_keys`` (``inspect --part``) overrides
    detection for the parts it names; a key the file lacks raises :class:`NotACheckpointError`.
    """
    contents = read_archive(path)
    warnings: list[str] = []
    tags = _device_tags(contents)
    gpu = sorted(t for t in tags if t != "cpu")
    if gpu:
        warnings.append(
            f"saved with device tags {', '.join(gpu)}: plain torch.load puts those tensors back on those "
            "devices (every rank on the same GPU, or an error on a CPU-only host); load with "
            "map_location=dist_resume.rank_map_location() or dist_resume.load_checkpoint()"
        )
    report: dict[str, Any] = {
        "schema": SCHEMA,
        "path": str(path),
        "file_bytes": contents.path.stat().st_size,
        "archive": _archive_info(contents),
        "layout": None,
        "tensors": _summary(contents, contents.obj),
        "device_tags": tags,
        "model": None,
        "optimizer": None,
        "scheduler": False,
        "scaler": False,
        "rng": False,
        "sampler": False,
        "ema": None,
        "part_keys": {},
        "saved_at": None,
        "meta": {},
        "extra_keys": sorted(map(str, contents.obj)) if isinstance(contents.obj, Mapping) else [],
        "warnings": warnings,
    }
    try:
        parts = split_checkpoint(contents.obj, source=str(path), part_keys=part_keys)
    except NotACheckpointError as err:
        if part_keys:  # the user named the keys: a key that is not there is their error, not a warning
            raise UsageError(str(err), hint="run `dist-resume inspect` without --part to see the file's keys") from err
        warnings.append(str(err))
        return report
    model = parts.model
    style = prefix_style(model)
    if style == "mixed":
        styles = sorted({prefix_style([k]) for k in model})
        warnings.append(
            f"model keys mix prefixes ({', '.join(styles)}): parts of the state dict come from "
            "differently wrapped models"
        )
    model_summary = _summary(contents, model)
    meta = dict(parts.meta)
    meta.setdefault("step", parts.step)
    meta.setdefault("epoch", parts.epoch)
    if parts.layout is Layout.TOOLKIT:
        meta.setdefault("format_version", contents.obj.get(Key.VERSION))
    report.update(
        layout=parts.layout.value,
        model={
            "keys": len(model),
            "tensors": model_summary["count"],
            "bytes": model_summary["bytes"],
            "prefix_style": style,
            "first_keys": list(model)[:5],
            "class": parts.meta.get("model_class"),
        },
        optimizer=_optimizer(contents, parts.optimizer, model, parts.meta, warnings),
        scheduler=parts.scheduler is not None,
        scaler=parts.scaler is not None,
        rng=parts.rng is not None,
        sampler=parts.sampler is not None,
        ema=_ema(parts.ema),
        part_keys=dict(parts.keys),
        saved_at=_saved_at(parts.meta),
        meta=jsonable(meta),
        extra_keys=sorted(str(k) for k in parts.extra) if isinstance(parts.extra, Mapping) else [],
    )
    return report


def _yes(flag: Any) -> str:
    return "yes" if flag else "no"


def _group_line(i: int, group: Mapping[str, Any]) -> str:
    shown = " ".join(f"{k}={v}" for k, v in group.items() if v is not None)
    return f"             group {i}: {shown or '-'}"


def _optimizer_lines(opt: Mapping[str, Any]) -> list[str]:
    lines = [
        f"optimizer    {opt['kind'] or 'unknown kind'}: {opt['param_groups']} group(s), "
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


def render_inspect(report: dict[str, Any]) -> str:
    """The human-readable form of a :func:`describe_checkpoint` report."""
    model, opt, meta = report["model"], report["optimizer"], report["meta"]
    lines = [
        f"checkpoint   {report['path']}  ({human_bytes(report['file_bytes'])}, "
        f"data.pkl {human_bytes(report['archive']['pickle_bytes'])})",
        f"layout       {report['layout'] or 'not recognised'}",
    ]
    if report.get("part_keys"):
        lines.append(f"parts        {describe_keys(report['part_keys'])}")
    if report.get("saved_at"):
        lines.append(f"saved        {report['saved_at']}")
    if model is not None:
        kind = f"{model['class']}: " if model.get("class") else ""
        lines.append(
            f"model        {kind}{model['keys']} keys, {model['tensors']} tensors, {human_bytes(model['bytes'])}, "
            f"prefix: {model['prefix_style']}"
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
    tags = ", ".join(
        f"{t} ({v['storages']} storages, {human_bytes(v['bytes'])})" for t, v in report["device_tags"].items()
    )
    lines.append(f"device tags  {tags or '-'}")
    shown = {
        k: v
        for k, v in meta.items()
        if v is not None
        and k in ("step", "epoch", "world_size", "torch_version", "format_version", "dist_resume_version")
    }
    lines.append("meta         " + (" ".join(f"{k}={v}" for k, v in shown.items()) or "-"))
    used = set(report.get("part_keys", {}).values())
    others = [k for k in report["extra_keys"] if k not in used]
    if others:
        lines.append(f"other keys   {preview(others, 10, quote=False)}")
    for w in report["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
