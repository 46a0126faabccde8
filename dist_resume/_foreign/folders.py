"""Checkpoint folders: HF Trainer ``checkpoint-N/``, Accelerate ``save_state``, DCP, dist_resume's sharded folder.

``detect_folder`` recognises a folder by its files; ``read_foreign_folder`` reads it into the same
:class:`CheckpointParts` a single file yields, through the reader of its kind (:mod:`.hf_folders`,
:mod:`.dcp`, :mod:`.sharded`).
"""

from __future__ import annotations

import re
from typing import Any, Final

from .._core.errors import NotACheckpointError, UsageError
from .._core.location import Location, RemotePath, local_path
from .._core.text import article, preview
from .._core.types import MapLocation
from .._format.manifest import MANIFEST, TRAIN_STATE
from .._layout.layout import CheckpointParts, Layout
from .hf_folders import has_weights, read_accelerate, read_hf, read_model_weights, trainer_progress
from .safetensors_read import SAFETENSORS_SUFFIX, is_safetensors
from .sharded import read_sharded

__all__ = [
    "FolderKind",
    "FOLDER_LAYOUTS",
    "detect_folder",
    "read_foreign_folder",
    "read_model_weights",
    "unrecognised_folder",
    "is_manager_folder",
    "trainer_progress",
    "foreign_kind",
    "checkpoint_subfolders",
]


FolderKind = Layout  # the folder kinds are FOLDER_LAYOUTS
FOLDER_LAYOUTS: Final = (Layout.HF_TRAINER, Layout.ACCELERATE, Layout.DCP, Layout.SHARDED)


# a CheckpointManager folder (dist_resume's own; _source.listing.CHECKPOINT_NAME plus its temps): files
# ckpt_<step>.pt and sharded checkpoint folders ckpt_<step>.dcp/
_OWN_FOLDER: Final = re.compile(r"^\.?ckpt_\d+\.(pt|dcp)(\.[0-9a-f]{16}\.tmp)?$")
_TEMP: Final = re.compile(r"^\..+\.[0-9a-f]{16}\.tmp$")  # _format.atomic.TEMP_NAME: a save or conversion in progress
_HF_FILES: Final = {"optimizer.pt", "scheduler.pt", "trainer_state.json"}
_ACCELERATE_FILES: Final = re.compile(r"^(optimizer|scheduler|sampler)(_\d+)?\.bin$|^random_states_\d+\.pkl$")
_HF_STEP_DIR: Final = re.compile(r"^checkpoint-(\d+)$")


def _names(folder: Location) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def _entries(folder: Location) -> list[str]:
    return [p.name for p in folder.iterdir()]


def is_manager_folder(path: Location) -> bool:
    """True when ``path`` is a folder holding ``CheckpointManager`` checkpoints (``ckpt_<step>.pt`` files,
    ``ckpt_<step>.dcp/`` folders) or their temporaries. Local."""
    folder = path
    return folder.is_dir() and any(_OWN_FOLDER.match(n) for n in _entries(folder))


def detect_folder(path: Location) -> Layout | None:
    """The kind of foreign checkpoint folder ``path`` is, or ``None`` (not a folder, unknown, or dist_resume's own).

    Local. A ``CheckpointManager`` folder (``ckpt_<step>.pt`` files, ``ckpt_<step>.dcp/`` folders) always
    yields ``None``, so the caller's own handling keeps priority. dist_resume's own sharded checkpoint folder
    (``manifest.json`` or ``train_state.pt`` next to DCP's files) is ``Layout.SHARDED``, complete or not: its
    reader and its integrity check say what is missing.
    """
    folder = path
    if not folder.is_dir():
        return None
    names = _names(folder)
    if {MANIFEST, TRAIN_STATE} & set(_entries(folder)):  # whatever they are (a FIFO, a link): its reader says
        return Layout.SHARDED
    if any(_OWN_FOLDER.match(n) for n in _entries(folder)):
        return None
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return Layout.DCP
    if any(_ACCELERATE_FILES.match(n) for n in names):
        return Layout.ACCELERATE
    if _HF_FILES & names or has_weights(names):
        return Layout.HF_TRAINER
    return None


def foreign_kind(path: Location) -> Layout | None:
    """The foreign layout ``path`` is (an HF Trainer, Accelerate or DCP folder, a ``.safetensors`` file), or None.

    Local; reads a folder's listing or a file's first bytes. A ``CheckpointManager`` folder, a torch
    file and anything unrecognised yield None.
    """
    p = path
    if isinstance(p, RemotePath):
        return _remote_kind(p)
    if p.is_dir():
        return detect_folder(p)
    if p.is_file() and (p.suffix == SAFETENSORS_SUFFIX or is_safetensors(p)):
        return Layout.SAFETENSORS
    return None


def _remote_kind(p: RemotePath) -> Layout | None:
    """:func:`foreign_kind` on an object store, where dist_resume reads its own checkpoints only (files and
    sharded checkpoint folders): any other layout is a :class:`UsageError` saying to copy it to local disk."""
    kind = Layout.SAFETENSORS if p.suffix == SAFETENSORS_SUFFIX else detect_folder(p) if p.is_dir() else None
    if kind in (None, Layout.SHARDED):
        return kind
    assert kind is not None
    raise UsageError(
        f"{str(p)!r} is {article(repr(kind.value))} checkpoint on an object store, and dist_resume reads those from "
        "local disk only (its own checkpoints, files and sharded folders, it reads from a store)",
        hint="copy it to local disk first (e.g. with the store's own CLI), then pass the local path",
    )


def read_foreign_folder(
    path: Location,
    layout: Layout | None = None,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
) -> CheckpointParts:
    """Read a foreign checkpoint folder of ``layout`` (None: detect it) into :class:`CheckpointParts`. Local.

    Raises :class:`NotACheckpointError` naming the files found and the folder kinds known for anything else.

    Example::

        >>> parts = read_foreign_folder(Path("out/checkpoint-500"), map_location="cpu")
        >>> parts.step, sorted(parts.model)[:1]
        (500, ['bert.embeddings.LayerNorm.bias'])
    """
    folder = path
    kind = detect_folder(folder) if layout is None else layout
    opts: dict[str, Any] = {"map_location": map_location, "mmap": mmap, "weights_only": weights_only}
    if kind is Layout.HF_TRAINER:
        return read_hf(local_path(folder, "reading an HF Trainer folder"), opts)
    if kind is Layout.ACCELERATE:
        return read_accelerate(local_path(folder, "reading an Accelerate folder"), opts)
    if kind is Layout.DCP:
        from .dcp import read_dcp  # torch.distributed.checkpoint costs ~1 s to import

        return read_dcp(folder, map_location=map_location, weights_only=weights_only)
    if kind is Layout.SHARDED:
        return read_sharded(folder, map_location=map_location, weights_only=weights_only)
    raise unrecognised_folder(folder)


def checkpoint_subfolders(folder: Location) -> list[Location]:
    """The folders directly inside ``folder`` that are checkpoints (foreign or ``CheckpointManager``), oldest first.

    Local. An HF Trainer ``output_dir`` holds ``checkpoint-N/`` folders: they sort by N.
    """
    if not folder.is_dir():
        return []
    subs = [
        p
        for p in folder.iterdir()
        if p.is_dir() and not _TEMP.match(p.name) and (detect_folder(p) is not None or is_manager_folder(p))
    ]
    return sorted(subs, key=lambda p: (int(m.group(1)) if (m := _HF_STEP_DIR.match(p.name)) else -1, p.name))


def unrecognised_folder(folder: Location) -> NotACheckpointError:
    """The error for a folder no reader recognises: what it holds, and which folders dist_resume reads. Local.

    A folder that holds checkpoint folders one level down (an HF Trainer ``output_dir``) says so and
    names the newest: resuming from the parent is a wrong path, never "nothing to resume".
    """
    subs = checkpoint_subfolders(folder)
    if subs:
        return NotACheckpointError(
            f"{str(folder)!r} is not a checkpoint itself but holds {len(subs)} checkpoint folder(s) one level down: "
            f"{preview((p.name + '/' for p in subs), 8)}; pass one of them, e.g. the newest: {str(subs[-1])!r}"
        )
    found = sorted(_names(folder)) if folder.is_dir() else []
    return NotACheckpointError(
        f"{str(folder)!r} is not a checkpoint folder dist_resume recognises (files: "
        f"{preview(found, 8) if found else 'none'}); known folders: a CheckpointManager folder (ckpt_<step>.pt, "
        "ckpt_<step>.dcp/), a sharded checkpoint folder (manifest.json, train_state.pt, DCP files), "
        f"{Layout.HF_TRAINER.value!r} (an HF Trainer checkpoint-N/: model.safetensors or pytorch_model.bin, "
        f"optimizer.pt, trainer_state.json), {Layout.ACCELERATE.value!r} (an Accelerate save_state folder: "
        f"model.safetensors, optimizer.bin) and {Layout.DCP.value!r} (a DCP folder "
        "written by torch.distributed.checkpoint: .metadata, *.distcp); a single checkpoint file (.pt, .pth, .ckpt, .bin, .safetensors) is read as well"
    )
