"""``dist-resume inspect``: what a checkpoint holds, as one report dict for every kind of source.

A torch file is read from its pickle alone (meta tensors, no tensor data); a foreign source (HF
Trainer, Accelerate or DCP folder, ``.safetensors`` file) as :mod:`._sources` says. Both
fill the same report (schema ``dist-resume/inspect/1``), which :func:`~._render.render_inspect` words.
"""

from __future__ import annotations

import datetime
import zipfile
import zlib
from collections.abc import Mapping
from typing import Any

from ..._core.errors import CheckpointCorruptError, NotACheckpointError, UsageError
from ..._core.location import Location
from ..._core.types import PathLike
from ..._core.untrusted import untrusted
from ..._format.archive import ArchiveContents, read_archive
from ..._layout.layout import CheckpointParts, Key, Layout, split_checkpoint
from ..._layout.meta import is_toolkit
from ..._sim import sim_tags_note
from ..._source.source import local_source
from ..._state.prefix import canonical_key, prefix_style
from ..._store.ranges import open_binary
from .._common import SCHEMA_PREFIX, jsonable
from ._optim import describe_optimizer
from ._sources import (
    SOURCE_META_KEYS,
    StorageOf,
    check_sharded,
    device_tags,
    read_foreign_source,
    summarize_tensors,
)

__all__ = ["describe_checkpoint"]

SCHEMA = f"{SCHEMA_PREFIX}/inspect/1"


def _archive_info(contents: ArchiveContents) -> dict[str, Any]:
    small = {}
    try:
        with open_binary(contents.path) as f, zipfile.ZipFile(f) as zf:
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


def _saved_at(meta: Mapping[str, Any]) -> str | None:
    """``meta['saved_at']`` (seconds since the epoch) as ``2025-01-02 03:04:05 UTC``, or None."""
    stamp = meta.get("saved_at")
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)):
        return None
    try:
        return datetime.datetime.fromtimestamp(stamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return None


def _report(path: PathLike, files: list[dict[str, Any]], tags: dict[str, dict[str, int]]) -> dict[str, Any]:
    """The report before its parts are known: what every source has."""
    warnings: list[str] = []
    gpu = sorted(t for t in tags if t != "cpu")
    if gpu:
        warnings.append(
            f"saved with device tags {', '.join(gpu)}: plain torch.load puts those tensors back on those "
            "devices (every rank on the same device, or an error on a host without them); load with "
            "map_location=dist_resume.rank_map_location() or dist_resume.load_checkpoint()"
        )
    sim = sim_tags_note(tags)
    if sim:
        warnings.append(sim)
    return {
        "schema": SCHEMA,
        "path": str(path),
        "file_bytes": sum(f["size"] for f in files),
        "files": files,
        "not_read": [],
        "tensor_data": None,
        "archive": None,
        "layout": None,
        "tensors": None,
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
        "extra_keys": [],
        "warnings": warnings,
        "sharded": None,
    }


def _lightning_prefix(model: Mapping[str, Any]) -> str | None:
    """``"model."`` when every key of a Lightning ``state_dict`` sits under one attribute of the LightningModule."""
    heads = {canonical_key(k).split(".", 1)[0] for k in model if "." in canonical_key(k)}
    return f"{heads.pop()}." if len(heads) == 1 and all("." in canonical_key(k) for k in model) else None


def _fill_parts(report: dict[str, Any], parts: CheckpointParts, storage_of: StorageOf) -> None:
    """Describe ``parts`` into ``report``: the same words for a torch file and a foreign source."""
    warnings: list[str] = report["warnings"]
    model = parts.model
    style = prefix_style(model)
    if style == "mixed":
        styles = sorted({prefix_style([k]) for k in model})
        warnings.append(
            f"model keys mix prefixes ({', '.join(styles)}): parts of the state dict come from "
            "differently wrapped models"
        )
    model_summary = summarize_tensors(model, storage_of)
    meta = {k: v for k, v in parts.meta.items() if k not in SOURCE_META_KEYS}
    meta.setdefault("step", parts.step)
    meta.setdefault("epoch", parts.epoch)
    report.update(
        layout=parts.layout.value,
        model={
            "keys": len(model),
            "tensors": model_summary["count"],
            "bytes": model_summary["bytes"],
            "prefix_style": style,
            "key_prefix": _lightning_prefix(model) if parts.layout is Layout.LIGHTNING else None,
            "first_keys": list(model)[:5],
            "class": parts.meta.get("model_class"),
        },
        optimizer=describe_optimizer(parts.optimizer, storage_of, model, parts.meta, warnings),
        scheduler=parts.scheduler is not None,
        scaler=parts.scaler is not None,
        rng=parts.rng is not None,
        sampler=parts.sampler is not None,
        ema={"keys": len(parts.ema) if isinstance(parts.ema, Mapping) else None} if parts.ema is not None else None,
        part_keys=dict(parts.keys),
        saved_at=_saved_at(parts.meta),
        meta=jsonable(meta),
        extra_keys=sorted(str(k) for k in parts.extra) if isinstance(parts.extra, Mapping) else [],
    )


def describe_checkpoint(path: Location, *, part_keys: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``inspect --json`` report for ``path``: a torch file or a foreign source. Local.

    A torch file is read from its zip directory and data.pkl only. A file in no layout dist_resume
    knows is still described (tensors, device tags), with ``layout`` ``null`` and a warning saying
    why. ``part_keys`` (``inspect --part``) overrides detection for the parts it names; a key the
    file lacks raises :class:`UsageError`, and so does ``part_keys`` for a foreign source (its files
    name its parts). A sharded checkpoint folder (an FSDP2 save) is checked whole first (every file its manifest
    lists, with its size and CRC-32; a damaged one raises naming the file) and ``sharded`` says how it was written.
    """
    where = path
    sharded = check_sharded(where)
    layout = local_source(where).layout
    if layout is not None:
        if part_keys:
            raise UsageError(
                f"--part names keys of a torch file, but {str(path)!r} is a foreign source "
                f"(layout {layout.value!r}) whose files name its parts",
                hint="run `dist-resume inspect` without --part",
            )
        source = read_foreign_source(where, layout)
        with untrusted(f"checkpoint {str(path)!r}", "its parts"):  # the boundary: describing what the files hold
            report = _report(path, source.files, source.device_tags)
            parts = source.parts
            report.update(not_read=source.not_read, tensor_data=source.tensor_data, sharded=sharded)
            report["tensors"] = summarize_tensors((parts.model, parts.optimizer, parts.ema), source.storage_of)
            _fill_parts(report, parts, source.storage_of)
            return report
    contents = read_archive(where)
    with untrusted(f"checkpoint {str(path)!r}", "its structure"):  # the boundary: describing what the file holds
        return _describe_archive(path, contents, part_keys)


def _describe_archive(path: Location, contents: ArchiveContents, part_keys: Mapping[str, str] | None) -> dict[str, Any]:
    report = _report(path, [{"name": path.name, "size": contents.path.stat().st_size}], device_tags(contents))
    report.update(
        archive=_archive_info(contents),
        tensors=summarize_tensors(contents.obj, contents.storage_of),
        tensor_data="not read (meta tensors from data.pkl)",
        extra_keys=sorted(map(str, contents.obj)) if isinstance(contents.obj, Mapping) else [],
    )
    try:
        parts = split_checkpoint(contents.obj, source=str(path), part_keys=part_keys)
    except NotACheckpointError as err:
        if part_keys:  # the user named the keys: a key that is not there is their error, not a warning
            raise UsageError(str(err), hint="run `dist-resume inspect` without --part to see the file's keys") from err
        if is_toolkit(contents.obj):  # a dist_resume file the verdict refuses (list, latest(), the manager): alike
            raise
        report["warnings"].append(str(err))
        return report
    _fill_parts(report, parts, contents.storage_of)
    if parts.layout is Layout.TOOLKIT:
        report["meta"].setdefault("format_version", jsonable(contents.obj.get(Key.VERSION)))
    return report
