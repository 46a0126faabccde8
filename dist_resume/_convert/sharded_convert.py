"""Converting between dist_resume's sharded checkpoint folder (what an FSDP2 model saves) and one torch file.

Folder to file: the payload the folder holds (:func:`~dist_resume._foreign.sharded.load_sharded_payload`), full
tensors, written as the one file a DDP save would have written: model under canonical keys, optimizer state by
ids with ``param_names``, scheduler, scaler, step, epoch, every rank's RNG streams, the sampler position.

File to folder: the file's payload written as a sharded folder by this one process (``dcp.save`` with
``no_dist=True``: every tensor whole in ``__0_0.distcp``), with its ``train_state.pt`` and manifest. It needs no
world size: DCP reshards on load, so ``dcp.load`` and an FSDP2 resume read it at any world size and mesh.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._core.errors import NotACheckpointError, UsageError
from .._core.text import article
from .._core.torch_compat.private import allowing_plain_globals
from .._foreign.sharded import load_sharded_payload, new_manifest, split_payload
from .._format.atomic import atomic_write
from .._format.manifest import MANIFEST, TRAIN_STATE, file_entry
from .._layout.layout import FORMAT_NAME, Key, Layout, split_checkpoint
from .._source.open import load_checkpoint
from .._state.prefix import prefix_style
from .dcp_write import write_dcp
from .formats import WriterReport, dsd_optimizer, parts_payload, plain_namespaces, save_locked
from .output import replace_folder
from .rekey import KeyForm, rekey_param_names, rekey_state_dict

__all__ = ["sharded_to_pt", "pt_to_sharded"]


def sharded_to_pt(src: Path, dst: Path, to: KeyForm | None) -> WriterReport:
    """A sharded checkpoint folder as one dist_resume ``.pt`` file (model keys in the ``to`` form). Local."""
    payload = load_sharded_payload(src)
    model = payload[Key.MODEL]
    before = prefix_style(model)
    renamed = rekey_state_dict(model, to, repr(str(src))) if to is not None else 0
    names = rekey_param_names(payload.get(Key.OPTIMIZER), to, repr(str(src))) if to is not None else 0
    written = save_locked(dst, payload)
    return WriterReport(Layout.SHARDED, before, prefix_style(model), len(model), renamed, names, written)


def _payload(src: Path, source: str, part_keys: Any) -> tuple[dict[str, Any], Layout, str, int]:
    """``src``'s dist_resume payload (a dist_resume file as it is; any other layout through its parts), its model
    under canonical keys and its optimizer keyed by name; the layout read, the model's key prefix before and how
    many keys lost it."""
    with allowing_plain_globals():
        obj = load_checkpoint(src, map_location="cpu", mmap=True)
    obj = plain_namespaces(obj)
    parts = split_checkpoint(obj, source=source, part_keys=part_keys)
    before = prefix_style(parts.model)
    if isinstance(obj, dict) and obj.get(Key.FORMAT) == FORMAT_NAME and not part_keys:
        payload = dict(obj)
    else:
        payload = parts_payload(parts, None, source)[0]
    ema = payload.get(Key.EMA)
    if ema is not None and not isinstance(ema, Mapping):  # saved through DCP beside the model: a state dict
        raise NotACheckpointError(
            f"{source}: its EMA entry is {article(type(ema).__name__)}, not a state dict, so it cannot be written as "
            "a sharded checkpoint (the file is damaged or was edited); remove the entry, or convert another checkpoint"
        )
    model = OrderedDict(payload[Key.MODEL])
    meta = getattr(payload[Key.MODEL], "_metadata", None)
    if meta is not None:
        model._metadata = meta  # type: ignore[attr-defined]
    renamed = rekey_state_dict(model, KeyForm.SINGLE, source)
    payload[Key.MODEL] = model
    optimizer = dsd_optimizer(payload.get(Key.OPTIMIZER), model, parts.meta, source)
    if optimizer is not None:
        payload[Key.OPTIMIZER] = optimizer
    return payload, parts.layout, before, renamed


def pt_to_sharded(src: Path, dst: Path, to: KeyForm | None, part_keys: Any) -> WriterReport:
    """A torch checkpoint file as a sharded checkpoint folder, written by this one process. Local."""
    if to is KeyForm.DDP:
        raise UsageError(
            "--to ddp does not apply to a sharded checkpoint folder: it keys everything by canonical name",
            "leave --to out (or pass --to single)",
        )
    source = repr(str(src))
    payload, layout, before, renamed = _payload(src, source, part_keys)
    dcp_state, train_state = split_payload(payload)
    meta = payload.get(Key.META) or {}
    world = meta.get("world_size")
    step, epoch = meta.get("step"), meta.get("epoch")

    def fill(tmp: Path) -> None:
        write_dcp(dcp_state, tmp, source)
        atomic_write(tmp / TRAIN_STATE, lambda f: torch.save(train_state, f))
        files = [file_entry(tmp / n, 0) for n in sorted(os.listdir(tmp)) if (tmp / n).is_file()]
        manifest = new_manifest(
            files,
            list(dcp_state),
            step=step if type(step) is int else None,
            epoch=epoch if type(epoch) is int else None,
            world_size=world if type(world) is int and world > 0 else 1,
        )
        atomic_write(tmp / MANIFEST, lambda f: f.write(manifest.to_json()))

    replace_folder(dst, fill)
    model = dcp_state[Key.MODEL]
    written = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    groups = (dcp_state.get(Key.OPTIMIZER) or {}).get("param_groups") or ()
    names = sum(len(g.get("param_names") or ()) for g in groups)
    return WriterReport(layout, before, prefix_style(model), len(model), renamed, names, written)
