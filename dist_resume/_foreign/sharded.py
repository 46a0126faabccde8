"""dist_resume's sharded checkpoint folder: what goes into torch's DCP files and what into ``train_state.pt``, and
reading one back as the payload a DDP save would have written.

A dist_resume payload (:func:`~dist_resume._save.save.build_payload`) splits in two:

- the **DCP state**, ``{"model": ..., "optimizer": ..., "ema": ...}``, saved with ``torch.distributed.checkpoint``
  (each rank writes its own shards): the model under canonical keys, the optimizer keyed by canonical FQN as DSD's
  ``get_optimizer_state_dict`` keys it (state and each group's ``params`` by name, no integer ids), the EMA's
  canonical state. ``dcp.load`` into ``{"model": get_model_state_dict(m), "optimizer":
  get_optimizer_state_dict(m, opt)}`` restores them at any world size (DCP reshards on load);
- the **train state**, everything else (``format``, ``meta``, ``scheduler``, ``scaler``, ``extra``, ``rng`` per
  rank, ``sampler``), one small torch file written by global rank 0, loadable with ``weights_only=True``; its
  ``sharded_layout`` entry records what DCP does not keep (key order, ``state_dict._metadata``).

:func:`join_payload` undoes :func:`split_payload`: the result is the payload, keys and order included, with full
tensors and the optimizer keyed by ids with ``param_names``.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, CheckpointWriteError
from .._core.location import Location
from .._core.text import preview
from .._core.tree import map_tensors
from .._core.types import MapLocation
from .._core.version import __version__
from .._format.load import load_torch_file
from .._format.manifest import MANIFEST, SHARD_FILE, TRAIN_STATE, FileEntry, Manifest, read_manifest
from .._format.sharded_files import manifest_problems, rank_share
from .._format.sharded_layout import SHARDED_LAYOUT, layout_problem, lost_keys_problem
from .._layout.layout import CheckpointParts, Key, Layout, split_checkpoint
from .._state.optim.keys import normalize_optimizer_state, optimizer_by_name

__all__ = [
    "DCP_PARTS",
    "SHARDED_LAYOUT",
    "split_payload",
    "join_payload",
    "new_manifest",
    "checked_manifest",
    "checked_layout",
    "load_sharded_payload",
    "read_sharded",
]

DCP_PARTS: Final = (Key.MODEL, Key.OPTIMIZER, Key.EMA)  # the payload entries saved through DCP


def _names_of(optimizer: Mapping[str, Any]) -> list[str]:
    """One canonical name per parameter id, in the groups' order, from the groups' ``param_names``."""
    groups = optimizer["param_groups"]
    if all(isinstance(p, str) for g in groups for p in g["params"]):
        return [p for g in groups for p in g["params"]]  # keyed by name already
    missing = [i for i, g in enumerate(groups) if len(g.get("param_names") or ()) != len(g["params"])]
    if missing:
        raise CheckpointWriteError(
            f"the optimizer's param group(s) {missing} carry no parameter names, so its state cannot be keyed by "
            "parameter name as a sharded checkpoint keys it; pass the model the optimizer trains (its parameters "
            "name the state), or build the optimizer from model.named_parameters()"
        )
    return [n for g in groups for n in g["param_names"]]


def _metadata(state: Any) -> Any:
    return getattr(state, "_metadata", None)


def split_payload(payload: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(DCP state, train state)`` of a dist_resume payload. Local; no tensor is copied."""
    dcp_state: dict[str, Any] = {}
    train_state: dict[str, Any] = {}
    for key, value in payload.items():
        if key not in DCP_PARTS:
            train_state[key] = value
        elif key == Key.OPTIMIZER:
            dcp_state[key] = optimizer_by_name(value, _names_of(value))
        else:
            dcp_state[key] = dict(value)
    layout: dict[str, Any] = {"order": list(payload)}
    for key in (Key.MODEL, Key.EMA):
        if key in payload:
            layout[f"{key}_keys"] = list(payload[key])
            layout[f"{key}_metadata"] = _metadata(payload[key])
    train_state[SHARDED_LAYOUT] = layout
    return dcp_state, train_state


def _ordered(state: Mapping[str, Any], keys: list[str] | None, metadata: Any) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict((k, state[k]) for k in keys or () if k in state)
    out.update((k, v) for k, v in state.items() if k not in out)
    if metadata is not None:
        out._metadata = metadata  # type: ignore[attr-defined]
    return out


def _optimizer(saved: Any, where: str) -> dict[str, Any]:
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    if not (
        isinstance(saved, Mapping)
        and isinstance(saved.get("state", {}), Mapping)
        and isinstance(groups, list)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)
    ):
        raise CheckpointCorruptError(
            f"{where}: its optimizer entry is not an optimizer state dict (param_groups of lists of params); the "
            "folder is damaged: resume from an earlier checkpoint"
        )
    by_ids = normalize_optimizer_state({"state": saved.get("state", {}), "param_groups": saved["param_groups"]})
    state = by_ids["state"]
    return {**by_ids, "state": {k: state[k] for k in sorted(state, key=lambda k: (type(k) is not int, str(k)))}}


def checked_layout(train_state: Any, where: str) -> Mapping[str, Any]:
    """``train_state``'s ``sharded_layout`` entry, every field typed (what :func:`join_payload` reads), or
    :class:`CheckpointCorruptError` naming ``where`` (the train state file). Local."""
    problem = layout_problem(train_state)
    if problem is not None:
        raise CheckpointCorruptError(
            f"{where} is damaged: {problem}; it is not the train state of a sharded checkpoint as a save writes it: "
            "resume from an earlier checkpoint"
        )
    return dict(train_state[SHARDED_LAYOUT])


def join_payload(dcp_state: Mapping[str, Any], train_state: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The payload :func:`split_payload` split (full tensors where DCP gave them), in its original key order;
    ``where`` names the folder in an error."""
    layout = checked_layout(train_state, f"{where}: {TRAIN_STATE}")
    held = {k: v for k, v in dcp_state.items() if k in (Key.MODEL, Key.EMA) and isinstance(v, Mapping)}
    lost = lost_keys_problem(layout, held)
    if lost is not None:
        raise CheckpointCorruptError(
            f"{where}: its {TRAIN_STATE} and .metadata disagree: {lost}; .metadata lost them: the folder is damaged, "
            "resume from an earlier checkpoint"
        )
    parts: dict[str, Any] = {k: v for k, v in train_state.items() if k != SHARDED_LAYOUT}
    for key in DCP_PARTS:
        if key not in dcp_state:
            continue
        if key == Key.OPTIMIZER:
            parts[key] = _optimizer(dcp_state[key], where)
        else:
            parts[key] = _ordered(dcp_state[key], layout.get(f"{key}_keys"), layout.get(f"{key}_metadata"))
    order = [k for k in layout.get("order", ()) if k in parts]
    return {**{k: parts[k] for k in order}, **{k: v for k, v in parts.items() if k not in order}}


def new_manifest(
    files: list[FileEntry],
    contents: list[str],
    *,
    step: int | None,
    epoch: int | None,
    world_size: int,
    mesh: tuple[tuple[int, ...] | None, tuple[str, ...] | None] = (None, None),
) -> Manifest:
    """The manifest of a folder just written: ``files`` (every file but the manifest), the DCP state's top-level
    entries, a fresh save id, this torch's and this dist_resume's versions. ``mesh``: the device mesh's shape and
    dimension names (None: written from full tensors). Local."""
    writers = len({f.rank for f in files if SHARD_FILE.match(f.name)})
    shape, names = mesh
    return Manifest(
        step,
        epoch,
        world_size,
        shape,
        names,
        writers,
        tuple(contents),
        tuple(files),
        secrets.token_hex(16),
        time.time(),
        str(torch.__version__),
        __version__,
    )


def checked_manifest(folder: Location, share: tuple[int, int] | None = None) -> Manifest:
    """The folder's manifest, every file it lists there with its size and nothing else, ``.metadata`` describing the
    listed shards (CRCs are ``verify``'s); ``share`` ``(rank, world_size)``: this rank's part of the CRC-32 check the
    ranks split (:func:`~dist_resume._format.manifest.rank_share`). Local."""
    manifest, _ = read_manifest(folder)
    mine = None if share is None else rank_share(manifest, *share)
    problems = manifest_problems(folder, manifest, verify=mine is not None, share=mine)
    if problems:
        raise CheckpointCorruptError(
            f"sharded checkpoint {str(folder)!r} differs from its {MANIFEST}: "
            f"{preview((f'{p.name} {p.problem}' for p in problems), 3, sep='; ', quote=False)}; copy the whole "
            "folder again, or resume from an earlier checkpoint"
        )
    return manifest


def load_sharded_payload(path: Location, *, weights_only: bool = True) -> dict[str, Any]:
    """A sharded checkpoint folder as the payload one file would hold: full CPU tensors. Local (no process group).

    The manifest is checked first (every file there with its size); ``train_state.pt`` is read like any torch
    file (its small records' CRCs checked), the DCP files by torch's DCP reader.
    """
    from .dcp import load_dcp_state  # torch.distributed.checkpoint costs ~1 s to import

    folder = path
    manifest = checked_manifest(folder)
    train_state = load_torch_file(folder / TRAIN_STATE, map_location="cpu", mmap=False, weights_only=weights_only)
    checked_layout(train_state, repr(str(folder / TRAIN_STATE)))
    dcp_state = load_dcp_state(folder, weights_only=weights_only)
    absent = [c for c in manifest.contents if c not in dcp_state]
    if absent:
        raise CheckpointCorruptError(f"sharded checkpoint {str(folder)!r}: its DCP files hold no {absent}")
    return join_payload(dcp_state, train_state, f"sharded checkpoint {str(folder)!r}")


def read_sharded(path: Location, *, map_location: MapLocation = None, weights_only: bool = True) -> CheckpointParts:
    """A sharded checkpoint folder as :class:`CheckpointParts` with full tensors. Local: every rank may read it.

    ``map_location``: a device (None: the CPU). Every rank reading it holds the whole state: fine for a
    plain or DDP model, not what an FSDP2 resume should do with a large one.
    """
    from .dcp import folder_device

    folder = path
    payload = load_sharded_payload(folder, weights_only=weights_only)
    device = folder_device("cpu" if map_location is None else map_location, folder)
    if device.type != "cpu":
        payload = map_tensors(payload, lambda t: t.to(device))
    parts = split_checkpoint(payload, source=f"sharded checkpoint {str(folder)!r}")
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    meta = {**parts.meta, "source_layout": Layout.SHARDED.value, "files": files}
    return dataclasses.replace(parts, layout=Layout.SHARDED, meta=meta)
