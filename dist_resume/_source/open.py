"""One entry point for every checkpoint source: a torch file, a foreign folder, a ``.safetensors`` file.

:func:`open_checkpoint` returns an :class:`Opened`: either the object a torch file holds (split
later by :func:`~dist_resume._layout.layout.split_checkpoint`, which needs the live model's keys
and the caller's options), or the :class:`CheckpointParts` of a foreign source, split already by
the reader that knows its files (HF Trainer, Accelerate, DCP folders; a ``.safetensors`` file). A
``CheckpointManager`` folder is not a source here: ``_checkpoint`` resolves it to one file first.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .._core.errors import UsageError
from .._core.log import log_rank0
from .._core.text import preview
from .._core.types import MapLocation, PathLike
from .._foreign.folders import foreign_kind, is_manager_folder, read_folder, unrecognised_folder
from .._foreign.safetensors_read import read_safetensors
from .._format.load import load_torch_file
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .integrity import verify_source

__all__ = [
    "Opened",
    "load_checkpoint",
    "open_checkpoint",
    "foreign_kind",
    "source_kind",
    "is_foreign_source",
    "parts_as_dict",
    "parts_to_fields",
    "parts_from_fields",
]

_MORE: Final = (("more_models", "model"), ("more_optimizers", "optimizer"), ("more_schedulers", "scheduler"))


@dataclass(frozen=True)
class Opened:
    """A checkpoint source as read: ``obj`` (a torch file's object) or ``parts`` (a foreign source, split)."""

    path: Path
    obj: Any = None
    parts: CheckpointParts | None = None


def is_foreign_source(path: PathLike) -> bool:
    """True when :func:`open_checkpoint` reads ``path`` with a foreign reader (it yields parts). Local."""
    return foreign_kind(path) is not None


def source_kind(path: PathLike) -> Layout | None:
    """The foreign layout of ``path``, or None for a torch file; a folder no reader takes raises. Local.

    A ``CheckpointManager`` folder or an empty one raises :class:`CheckpointNotFoundError` (pass it
    to ``resume``); any other folder :class:`NotACheckpointError`, naming its files and the known
    folders, or the checkpoint folders it holds one level down (an HF Trainer ``output_dir``).
    """
    p = Path(path)
    kind = foreign_kind(p)
    if kind is None and p.is_dir():
        if is_manager_folder(p) or not any(p.iterdir()):  # check_file's error says what to pass instead
            load_torch_file(p)
        raise unrecognised_folder(p)
    return kind


def open_checkpoint(
    path: PathLike,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
) -> Opened:
    """Read any checkpoint source dist_resume knows. Local: every rank may call it.

    A torch file (``.pt``, ``.pth``, ``.ckpt``, ``.bin``) comes back as its object; an HF Trainer
    ``checkpoint-N/``, an Accelerate ``save_state`` folder, a DCP folder or a ``.safetensors`` file as
    :class:`CheckpointParts`. ``verify=True`` first checks every torch file's CRC-32s and every
    safetensors header (see :func:`~dist_resume._source.integrity.verify_source`). Raises
    :class:`NotACheckpointError` for a folder no reader recognises, listing its files and the known
    folders; a ``CheckpointManager`` folder or an empty one raises :class:`CheckpointNotFoundError`
    (pass it to ``resume``, which picks its newest complete checkpoint).

    Example::

        >>> opened = open_checkpoint("out/checkpoint-500", map_location="cpu")
        >>> opened.parts.layout.value, opened.parts.step
        ('hf-trainer', 500)
    """
    p = Path(path)
    kind = source_kind(p)
    if kind is None:
        return Opened(
            p, obj=load_torch_file(p, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
        )
    if verify:
        verify_source(p)
    if kind is Layout.SAFETENSORS:
        weights, metadata = read_safetensors(p, map_location="cpu" if map_location is None else map_location, mmap=mmap)
        meta = {"source_layout": kind.value, "files": [p.name], "safetensors_metadata": metadata}
        return Opened(p, parts=CheckpointParts(Layout.SAFETENSORS, weights, meta=meta, keys={"model": p.name}))
    parts = read_folder(p, map_location=map_location, mmap=mmap, weights_only=weights_only)
    _log_first_only(p, parts)
    return Opened(p, parts=parts)


def _log_first_only(path: Path, parts: CheckpointParts) -> None:
    for key, what in _MORE:
        more = parts.meta.get(key)
        if more:
            log_rank0(
                logging.INFO,
                "%s holds more than one %s: the first is read, not %s",
                path,
                what,
                preview(more, 4),
            )


def parts_as_dict(parts: CheckpointParts) -> dict[str, Any]:
    """A foreign source's parts as the dict ``load_checkpoint`` returns. Local.

    ``{"model", "optimizer", "scheduler", "scaler", "ema", "step", "epoch", "sampler", "rng", "extra",
    "meta"}``, each only when
    the source has it: the form :func:`split_checkpoint` reads back into the same parts (as its
    ``model+optimizer`` layout) and ``torch.save`` can write as it is.
    """
    out: dict[str, Any] = {"model": dict(parts.model)}
    for name in ("optimizer", "scheduler", "scaler", "ema", "step", "epoch", "sampler", "rng", "extra"):
        value = getattr(parts, name)
        if value is not None:
            out[name] = value
    if parts.meta:
        out["meta"] = dict(parts.meta)
    return out


def parts_to_fields(parts: CheckpointParts) -> dict[str, Any]:
    """``parts`` as a plain dict (the layout by its value) to send through an object broadcast. Local."""
    fields = {f.name: getattr(parts, f.name) for f in dataclasses.fields(parts)}
    fields["layout"] = parts.layout.value
    return fields


def parts_from_fields(fields: dict[str, Any]) -> CheckpointParts:
    """The :class:`CheckpointParts` :func:`parts_to_fields` sent; its tensors are the very objects in ``fields``."""
    return CheckpointParts(**{**fields, "layout": Layout(fields["layout"])})


def load_checkpoint(
    path: PathLike,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
    part_keys: Mapping[str, str] | None = None,
) -> Any:
    """``torch.load`` with rank-aware placement and errors that name the file and the fix.

    Local: every rank may call it; each one loads onto its own device. ``map_location`` defaults
    to :func:`rank_map_location` (``<accelerator>:<LOCAL_RANK>``, or ``cpu`` without one). ``mmap=True``
    maps a torch file instead of reading it into memory. Missing, empty, truncated, corrupt, foreign
    and unsafe files raise a :class:`CheckpointError` subclass, never a bare ``EOFError`` or
    ``UnpicklingError``. ``verify=True`` first checks the CRC-32 of every record (``torch.load``
    never does; reads the file once more) and raises :class:`CheckpointCorruptError` on a mismatch.

    A torch file comes back as ``torch.load`` returns it. A foreign source (an HF Trainer
    ``checkpoint-N/`` or Accelerate ``save_state`` folder, a DCP folder, a ``.safetensors`` file)
    comes back as one dict, ``{"model", "optimizer", "scheduler", "scaler", "ema", "step", "epoch",
    "meta"}`` with only the entries the source has (``meta`` names its layout and files): the form
    ``resume`` reads and ``torch.save`` writes as it is. See docs/sources.md.

    ``part_keys`` (e.g. ``{"model": "MODEL_STATE"}``, ``"state.net"`` one level down) asks for that
    same parts view of a torch file, its parts recognised as ``resume`` does and named where given;
    the view's ``meta["part_keys"]`` says which key each part came from. A key the file lacks is a
    :class:`NotACheckpointError` listing the keys it has. A foreign source's files name its parts,
    so ``part_keys`` is a :class:`UsageError` there.

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> dist_resume.load_checkpoint("ckpt.pt", map_location="cpu")["w"]
        tensor([1., 1.])
    """
    if part_keys is not None and source_kind(path) is not None:
        raise UsageError(
            f"part_keys names keys of a torch file, but {str(path)!r} is a foreign source whose files name its parts",
            hint="call load_checkpoint without part_keys",
        )
    opened = open_checkpoint(path, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
    if opened.parts is not None:
        return parts_as_dict(opened.parts)
    if part_keys is None:
        return opened.obj
    parts = split_checkpoint(opened.obj, f"checkpoint {str(path)!r}", part_keys=part_keys)
    view = parts_as_dict(parts)
    view["meta"] = {**view.get("meta", {}), "layout": parts.layout.value, "part_keys": dict(parts.keys)}
    return view
