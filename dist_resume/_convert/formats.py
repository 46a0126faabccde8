"""Converting between file formats: torch zip ``.pt``, ``.safetensors``, DCP folders, foreign folders.

Every conversion writes atomically. ``.pt`` <-> ``.safetensors`` copies tensor bytes file to file
and never deserializes them; a DCP export and a folder import load the tensors (torch's own DCP
writer and the folder readers need them in memory).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .._core.errors import KeyMismatchError, UsageError
from .._core.torch_compat.private import allowing_plain_globals
from .._core.tree import plain_namespaces
from .._foreign.safetensors_read import read_safetensors_header
from .._format.archive import read_archive
from .._layout.layout import FORMAT_NAME, FORMAT_VERSION, CheckpointParts, Key, Layout, split_checkpoint
from .._source.open import load_checkpoint
from .._state.optim.keys import check_optimizer_form, digit_id, optimizer_by_name
from .._state.prefix import canonical_key, prefix_style
from .archive_build import read_safetensors_meta, write_archive
from .dcp_write import write_dcp
from .output import replace_folder, write_locked
from .rekey import KeyForm, rekey_param_names, rekey_state_dict
from .safetensors_write import write_safetensors_from_archive

__all__ = [
    "ConvertFormat",
    "WriterReport",
    "plain_namespaces",
    "pt_to_safetensors",
    "safetensors_to_pt",
    "pt_to_dcp",
    "dsd_optimizer",
    "parts_payload",
    "parts_to_pt",
    "save_locked",
]

Progress = Callable[[int, int], None]


class ConvertFormat(enum.Enum):
    """The file format ``convert`` writes."""

    PT = "pt"  # a torch zip checkpoint (torch.save's format)
    SAFETENSORS = "safetensors"  # model weights only
    DCP = "dcp"  # a torch.distributed.checkpoint folder, {"model": ..., "optim": ...} as DSD keys them
    SHARDED = "sharded"  # dist_resume's sharded checkpoint folder (what an FSDP2 model saves): DCP + train state


@dataclass(frozen=True)
class WriterReport:
    """What one format writer did; :class:`~dist_resume.tools.ConvertResult` adds the paths, the key form and the time."""

    layout: enum.Enum
    prefix_before: str
    prefix_after: str
    model_keys: int
    renamed_keys: int
    param_names: int
    bytes_written: int


def _rekeyed(model: Mapping[str, Any], to: KeyForm, source: str) -> tuple[dict[str, Any], int]:
    out = dict(model)
    renamed = rekey_state_dict(out, to, source)
    return out, renamed


def _meta_number(metadata: Mapping[str, str], name: str) -> int | None:
    value = metadata.get(name, "")
    return digit_id(value)


def pt_to_safetensors(src: Path, dst: Path, to: KeyForm | None, part_keys: Mapping[str, str] | None) -> WriterReport:
    """The model weights of a torch zip checkpoint as ``.safetensors``, bytes copied. Local."""
    contents = read_archive(src)
    parts = split_checkpoint(contents.obj, source=repr(str(src)), part_keys=part_keys)
    tensors = {k: v for k, v in parts.model.items() if isinstance(v, torch.Tensor)}
    before = prefix_style(tensors)
    tensors, renamed = _rekeyed(tensors, to or KeyForm.SINGLE, repr(str(src)))
    metadata = {"format": "pt"}
    for name in ("step", "epoch"):
        value = getattr(parts, name)
        if value is not None:
            metadata[name] = str(value)

    def fill(fd: int, tmp: Path) -> int:
        size = write_safetensors_from_archive(contents, tensors, metadata, fd)
        read_safetensors_header(tmp)  # the header we wrote validates against the file's size
        return size

    written = write_locked(dst, fill)
    return WriterReport(parts.layout, before, prefix_style(tensors), len(tensors), renamed, 0, written)


def _param_names(optimizer: Any) -> list[list[str]]:
    if not isinstance(optimizer, Mapping):
        return []
    groups = optimizer.get("param_groups") or ()
    return [g["param_names"] for g in groups if isinstance(g, Mapping) and isinstance(g.get("param_names"), list)]


def safetensors_to_pt(src: Path, dst: Path, to: KeyForm | None, progress: Progress | None) -> WriterReport:
    """A ``.safetensors`` file as a dist_resume ``.pt`` checkpoint (model only), bytes copied. Local."""
    raw = read_safetensors_meta(src)
    model: dict[str, Any] = dict(raw.tensors)
    before = prefix_style(model)
    renamed = rekey_state_dict(model, to, repr(str(src))) if to is not None else 0
    meta = {
        "step": _meta_number(raw.metadata, "step"),
        "epoch": _meta_number(raw.metadata, "epoch"),
        "source_format": ConvertFormat.SAFETENSORS.value,
        "safetensors_metadata": dict(raw.metadata),
    }
    obj = {Key.FORMAT: FORMAT_NAME, Key.VERSION: FORMAT_VERSION, Key.MODEL: model, Key.META: meta}
    written = write_locked(dst, lambda fd, tmp: write_archive(raw, obj, fd, progress)[0])
    return WriterReport(Layout.SAFETENSORS, before, prefix_style(model), len(model), renamed, 0, written)


def _pairs_by_position(
    optimizer: Mapping[str, Any], groups: list[Any], ids: list[Any], model: Mapping[str, Any], meta: Mapping[str, Any]
) -> bool:
    """Whether unnamed optimizer state can be paired with the model's keys by position, with no guess.

    Only ``torch.optim.X(model.parameters())`` lists parameters in state-dict order: one group, as
    many parameters as model entries (so no buffers), every state tensor shaped like its model
    tensor, and a model read from a torch file (a foreign reader's key order is the file's, e.g.
    sorted, not the module's). Decay/no-decay groups or layer-wise learning rates reorder them.
    """
    if len(groups) != 1 or len(ids) != len(model) or meta.get("source_layout") or meta.get("source_format"):
        return False
    shapes = {i: tuple(t.shape) for i, t in zip(ids, model.values()) if isinstance(t, torch.Tensor)}
    for pid, state in optimizer["state"].items():
        if pid not in shapes or not isinstance(state, Mapping):
            return False
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shapes[pid]:
                return False
    return True


def dsd_optimizer(
    optimizer: Any, model: Mapping[str, Any], meta: Mapping[str, Any], source: str
) -> dict[str, Any] | None:
    """An optimizer state dict in DSD's ``get_state_dict`` form: state and ``params`` keyed by canonical FQN."""
    if optimizer is None:
        return None
    check_optimizer_form(optimizer, source)
    groups = optimizer["param_groups"]
    ids = [p for g in groups for p in g["params"]]
    named = _param_names(optimizer)
    if len(named) == len(groups) and sum(map(len, named)) == len(ids):
        names = [canonical_key(n) for g in named for n in g]
    elif all(isinstance(p, str) for p in ids):
        names = [canonical_key(p) for p in ids]  # already DSD's form
    elif _pairs_by_position(optimizer, groups, ids, model, meta):
        names = list(model)  # one group, no buffers, every state shape fits: parameters in state-dict order
    else:
        raise UsageError(
            f"{source}: the optimizer's {len(ids)} parameters in {len(groups)} group(s) carry no names (no "
            f"'param_names'), and the model's {len(model)} entries do not pair with them by position beyond doubt, "
            "so which state belongs to which parameter is unknown",
            "build the optimizer from model.named_parameters() (torch >= 2.5 stores param_names) and save again, "
            "or convert to --format pt and restore with dist_resume",
        )
    return optimizer_by_name(optimizer, names)


def pt_to_dcp(src: Path, dst: Path, to: KeyForm | None, part_keys: Mapping[str, str] | None) -> WriterReport:
    """A torch zip checkpoint as a DCP folder as DSD writes it: ``{"model", "optim"}`` keyed by FQN. Local."""
    if to is KeyForm.DDP:
        raise UsageError(
            "--to ddp does not apply to a DCP folder: DCP and DSD key everything by canonical FQN",
            "leave --to out (or pass --to single)",
        )
    with allowing_plain_globals():
        obj = load_checkpoint(src, map_location="cpu", mmap=True)
    source = repr(str(src))
    parts = split_checkpoint(plain_namespaces(obj), source=source, part_keys=part_keys)
    before = prefix_style(parts.model)
    model, renamed = _rekeyed(parts.model, KeyForm.SINGLE, source)
    state: dict[str, Any] = {"model": model}
    optim = dsd_optimizer(parts.optimizer, model, parts.meta, source)
    if optim is not None:
        state["optim"] = optim
    for name in ("scheduler", "scaler", "step", "epoch"):
        if getattr(parts, name) is not None:
            state[name] = getattr(parts, name)

    replace_folder(dst, lambda tmp: write_dcp(state, tmp, source))
    written = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    return WriterReport(
        parts.layout, before, prefix_style(model), len(model), renamed, sum(map(len, _param_names(optim))), written
    )


def parts_payload(parts: CheckpointParts, to: KeyForm | None, source: str) -> tuple[dict[str, Any], int, int]:
    """Checkpoint parts read from a foreign folder as a dist_resume payload, re-keyed ``to`` (None: as they are);
    and how many model keys and optimizer ``param_names`` were renamed. Local."""
    model = dict(parts.model)
    if not model:
        raise KeyMismatchError(f"{source}: no model weights were found to write")
    renamed = rekey_state_dict(model, to, source) if to is not None else 0
    optimizer = parts.optimizer
    names = rekey_param_names(optimizer, to, source) if to is not None else 0
    meta = {**plain_namespaces(dict(parts.meta)), "step": parts.step, "epoch": parts.epoch}
    obj: dict[str, Any] = {Key.FORMAT: FORMAT_NAME, Key.VERSION: FORMAT_VERSION, Key.MODEL: model, Key.META: meta}
    for key, value in (
        (Key.OPTIMIZER, optimizer),
        (Key.SCHEDULER, parts.scheduler),
        (Key.SCALER, parts.scaler),
        (Key.EXTRA, parts.extra),
        (Key.EMA, parts.ema),
    ):
        if value is not None:
            obj[key] = plain_namespaces(value)
    return obj, renamed, names


def parts_to_pt(parts: CheckpointParts, dst: Path, to: KeyForm | None, source: str) -> WriterReport:
    """Checkpoint parts read from a foreign folder as a dist_resume ``.pt`` file (tensors were loaded). Local."""
    before = prefix_style(parts.model)
    obj, renamed, names = parts_payload(parts, to, source)
    model = obj[Key.MODEL]
    written = save_locked(dst, obj)
    return WriterReport(parts.layout, before, prefix_style(model), len(model), renamed, names, written)


def save_locked(dst: Path, obj: Any) -> int:
    """``torch.save(obj)`` into ``dst`` atomically (:func:`write_locked`); the file's size. Local."""

    def fill(fd: int, tmp: Path) -> int:
        with open(fd, "wb", closefd=False) as f:
            torch.save(obj, f)
        return os.fstat(fd).st_size

    return write_locked(dst, fill)
