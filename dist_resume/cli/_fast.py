"""``dist-resume list`` without torch: the rows of a folder of sound checkpoints; the toolkit's names both fast paths
read (``verify``'s is :mod:`._fast_verify`).

The torch path (:func:`._list.list_folder` with ``fast=False``) reads each checkpoint's metadata with torch's
``weights_only`` unpickler, which costs the import of torch (seconds) before the first row. Here each
``ckpt_<step>.pt`` is read with :func:`~dist_resume._format.peek.peek_archive` (the same zip and CRC-32 checks,
a stub unpickler) and each ``ckpt_<step>.dcp/`` with its manifest and the peeked ``train_state.pt``. This path
only confirms: the first checkpoint that is damaged, foreign, renamed or in any way doubtful raises
:class:`PeekUnsure`, and the torch path lists the folder and words what is wrong. So both paths give the same
report (tests/test_cli_fast.py compares them on a corpus of sound, damaged and foreign folders).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointError
from .._core.location import Location, RemotePath
from .._format.manifest import SHARD_FILE, TRAIN_STATE, read_manifest
from .._format.peek import PeekUnsure, peek_archive
from .._format.records import read_records
from .._format.sharded_files import declared_keys, manifest_problems
from .._format.sharded_layout import SHARDED_LAYOUT, layout_problem, lost_keys_problem
from .._format.zip_verify import verify_zip
from .._layout.meta import FORMAT_NAME, Key, is_toolkit, toolkit_meta
from .._layout.meta import FORMAT_VERSION as _VERSION

__all__ = [
    "CHECKPOINT_NAME",
    "FORMAT_KEY",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_KEY",
    "PLAIN",
    "fast_entries",
    "shards_of",
]

# the name of dist_resume._source.listing (which imports torch); the test of this module checks that it is the same
CHECKPOINT_NAME: Final = re.compile(r"^ckpt_(\d+)\.(pt|dcp)$")
FORMAT_KEY: Final = Key.FORMAT
META_KEY: Final = Key.META
FORMAT_VERSION: Final = (Key.VERSION, _VERSION)  # (a file without it: version 1)
PLAIN: Final = (type(None), bool, int, float, str)  # the values a stub reads as they are


def _meta(obj: Any, step: int) -> Mapping[str, Any]:
    """The metadata of a sound checkpoint of ``step``, or :class:`PeekUnsure`; checked by the torch path's own
    :func:`~dist_resume._layout.meta.toolkit_meta` (torch-free), which refuses what it refuses."""
    if not is_toolkit(obj) or not isinstance(obj.get(META_KEY), Mapping):
        raise PeekUnsure("no dist_resume metadata")
    meta = toolkit_meta(obj, "checkpoint")  # a version or entry the torch path refuses: NotACheckpointError, unsure
    if type(meta.get("step")) is not int or meta["step"] != step:
        raise PeekUnsure(f"step {meta.get('step')!r} in a checkpoint named for step {step}")
    return meta


def _file(path: Path, step: int, verify: bool) -> tuple[Mapping[str, Any], int]:
    if not path.is_file() or path.is_symlink():
        raise PeekUnsure(f"{path.name} is not a regular file")
    read_records(path)
    if verify and verify_zip(path, strict=False):
        raise PeekUnsure(f"{path.name} fails its CRC-32 check")
    obj = peek_archive(path).obj
    model = obj.get("model") if isinstance(obj, Mapping) else None
    if not isinstance(model, Mapping) or not all(type(k) is str for k in model):
        raise PeekUnsure(f"{path.name}: its model entry is not a state dict")  # the torch path says what it is
    return _meta(obj, step), path.stat().st_size


def _folder(path: Path, step: int, verify: bool) -> tuple[Mapping[str, Any], int]:
    if not path.is_dir() or path.is_symlink():
        raise PeekUnsure(f"{path.name} is not a folder")
    manifest, _ = read_manifest(path)
    if manifest.step != step or manifest_problems(path, manifest, verify=verify):
        raise PeekUnsure(f"{path.name} does not match its manifest")
    train_state = peek_archive(path / TRAIN_STATE).obj
    if layout_problem(train_state) is not None:
        raise PeekUnsure(f"{path.name}: its {TRAIN_STATE} is damaged")
    if lost_keys_problem(train_state[SHARDED_LAYOUT], declared_keys(path, manifest)) is not None:
        raise PeekUnsure(f"{path.name}: its {TRAIN_STATE} and .metadata disagree")
    return _meta(train_state, step), manifest.size


def _read(path: Path, step: int, verify: bool) -> tuple[Mapping[str, Any], int]:
    try:
        return (_folder if path.suffix == ".dcp" else _file)(path, step, verify)
    except (CheckpointError, OSError) as err:  # damaged: the torch path says how, in its words
        raise PeekUnsure(f"{path.name}: {err}") from err


def shards_of(path: Location) -> dict[str, Any]:
    """A sound sharded checkpoint folder's row detail in ``list``: how many shard files, written by how many
    ranks, on which device mesh (its manifest's words). Local; reads the manifest."""
    manifest, _ = read_manifest(path)
    return {
        "shard_files": sum(1 for f in manifest.files if SHARD_FILE.match(f.name)),
        "writers": manifest.writers,
        "mesh_shape": None if manifest.mesh_shape is None else list(manifest.mesh_shape),
    }


def fast_entries(folder: Location, verify: bool, now: float) -> list[dict[str, Any]]:
    """The rows of ``list`` for a folder of sound checkpoints, oldest first, or :class:`PeekUnsure`. Local.

    Without ``verify``, the newest checkpoint's CRC-32s are checked too (``resume`` checks them newest first:
    the torch path reports a checkpoint it would skip; here there must be none). A folder on an object store is the
    torch path's (:class:`PeekUnsure`)."""
    if isinstance(folder, RemotePath):
        raise PeekUnsure(f"{folder} is on an object store")
    try:
        names = os.listdir(folder)
    except OSError as err:
        raise PeekUnsure(f"cannot list {folder}") from err
    found = sorted((int(m.group(1)), folder / name) for name in names if (m := CHECKPOINT_NAME.match(name)))
    if not found:
        raise PeekUnsure("no checkpoint named ckpt_<step>.pt or .dcp")
    rows = []
    for step, path in found:
        meta, size = _read(path, step, verify)
        age = max(0.0, now - path.stat().st_mtime)
        entry: dict[str, Any] = {"name": path.name, "step": step, "epoch": meta.get("epoch")}
        entry |= {"world_size": meta.get("world_size"), "bytes": size, "age_seconds": round(age, 1)}
        shards = shards_of(path) if path.suffix == ".dcp" else None
        rows.append(entry | {"status": "valid", "reason": None, "shards": shards})
    if not verify:
        _read(*found[-1][::-1], verify=True)
    return rows
