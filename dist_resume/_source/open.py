"""``load_checkpoint``: any source dist_resume reads, on this rank, as one object.

A torch file comes back as its object; a foreign source (HF Trainer, Accelerate, DCP folders; a ``.safetensors``
file) as one dict of its parts (:func:`parts_as_dict`). A ``CheckpointManager`` folder is not a source here: it
needs every rank to agree on its newest file, which ``resume`` does (:mod:`~dist_resume._source.consensus`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._core.errors import UsageError
from .._core.location import Location
from .._core.types import MapLocation, PathLike
from .._layout.layout import CheckpointParts, split_checkpoint
from .._store.url import location
from .read import SourceContents, read_source
from .source import local_source

__all__ = ["load_checkpoint", "open_checkpoint", "parts_as_dict"]


def open_checkpoint(
    path: Location,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
) -> SourceContents:
    """Read any checkpoint source dist_resume knows, as this rank sees it. Local: every rank may call it.

    A torch file (``.pt``, ``.pth``, ``.ckpt``, ``.bin``) comes back as its object (``.obj``); an HF Trainer
    ``checkpoint-N/``, an Accelerate ``save_state`` folder, a DCP folder or a ``.safetensors`` file as
    :class:`CheckpointParts` (``.parts``). ``verify=True`` first checks every torch file's CRC-32s and every
    safetensors header. A folder no reader recognises raises as :func:`~dist_resume._source.source.local_source`
    says.

    Example::

        >>> contents = open_checkpoint(Path("out/checkpoint-500"), map_location="cpu")
        >>> contents.parts.layout.value, contents.parts.step
        ('hf-trainer', 500)
    """
    source = local_source(path)
    return read_source(source, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)


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
    and unsafe files raise a :class:`~dist_resume.errors.CheckpointError` subclass, never a bare ``EOFError`` or
    ``UnpicklingError``. ``verify=True`` first checks the CRC-32 of every record (``torch.load``
    never does; reads the file once more) and raises :class:`~dist_resume.errors.CheckpointCorruptError` on a
    mismatch.

    A torch file comes back as ``torch.load`` returns it. A foreign source (an HF Trainer
    ``checkpoint-N/`` or Accelerate ``save_state`` folder, a DCP folder, a ``.safetensors`` file)
    comes back as one dict, ``{"model", "optimizer", "scheduler", "scaler", "ema", "step", "epoch",
    "meta"}`` with only the entries the source has (``meta`` names its layout and files): the form
    ``resume`` reads and ``torch.save`` writes as it is. See docs/sources.md.

    A sharded checkpoint folder (an FSDP2 save, ``ckpt_<step>.dcp/``) comes back as its full state, the payload a
    DDP file holds (every tensor read whole into this rank's memory); to fill an FSDP2 model's shards use
    ``resume``. See docs/fsdp2.md.

    ``part_keys`` (e.g. ``{"model": "MODEL_STATE"}``, ``"state.net"`` one level down) asks for that
    same parts view of a torch file, its parts recognised as ``resume`` does and named where given;
    the view's ``meta["part_keys"]`` says which key each part came from. A key the file lacks is a
    :class:`~dist_resume.errors.NotACheckpointError` listing the keys it has. A foreign source's files name its
    parts, so ``part_keys`` is a :class:`~dist_resume.errors.UsageError` there.

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> dist_resume.load_checkpoint("ckpt.pt", map_location="cpu")["w"]
        tensor([1., 1.])
    """
    where = location(path)  # the entry: decided here, passed down as it is
    source = local_source(where)
    if part_keys is not None and source.layout is not None:
        raise UsageError(
            f"part_keys names keys of a torch file, but {str(path)!r} is a foreign source whose files name its parts",
            hint="call load_checkpoint without part_keys",
        )
    contents = read_source(source, map_location=map_location, mmap=mmap, weights_only=weights_only, verify=verify)
    if contents.parts is not None:
        return parts_as_dict(contents.parts)
    if part_keys is None:
        return contents.obj
    parts = split_checkpoint(contents.obj, f"checkpoint {str(path)!r}", part_keys=part_keys)
    view = parts_as_dict(parts)
    view["meta"] = {**view.get("meta", {}), "layout": parts.layout.value, "part_keys": dict(parts.keys)}
    return view
