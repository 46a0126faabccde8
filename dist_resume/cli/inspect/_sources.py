"""How ``dist-resume inspect`` reads a foreign source: its files, its parts, and what it leaves unread.

A ``.safetensors`` file is read from its header alone (meta tensors, no tensor byte). A folder (HF
Trainer, Accelerate, DCP) is read by the library's own reader, :func:`open_checkpoint`, on the CPU:
torch files and safetensors memory-mapped (pages untouched, so no tensor data is read), a DCP folder
through torch's DCP reader (which does read its tensors). The torch files of an HF Trainer or
Accelerate folder are also read as meta-tensor archives, for their device tags and for the
optimizer (the accelerator ``step`` warning needs the saved tags); a DCP folder has no device tags. Files only an unsafe unpickler reads are never opened.

How tensors and bytes are counted, whether read as meta tensors or memory-mapped, is here too
(:func:`summarize_tensors`, :func:`device_tags`): every kind of source is counted the same way.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, TypeAlias

import torch

from ..._core.errors import CheckpointCorruptError, DistResumeError
from ..._core.location import Location, local_path
from ..._core.tree import iter_tensors
from ..._foreign.safetensors_read import DTYPES, read_safetensors_header
from ..._format.archive import ArchiveContents, StorageInfo, read_archive
from ..._format.manifest import MANIFEST, SHARD_FILE, read_manifest
from ..._format.sniff import FileKind, file_kind
from ..._layout.layout import CheckpointParts, Layout
from ..._source.integrity import source_files, verify_source
from ..._source.listing import CHECKPOINT_NAME
from ..._source.open import open_checkpoint
from .._common import dtype_name

__all__ = [
    "ForeignSource",
    "read_foreign_source",
    "SOURCE_META_KEYS",
    "StorageOf",
    "summarize_tensors",
    "loaded_storage_of",
    "chain_storage_of",
    "device_tags",
    "is_sharded_folder",
    "check_sharded",
]

StorageOf: TypeAlias = Callable[[torch.Tensor], "StorageInfo | None"]
"""The saved storage behind a tensor (its bytes counted once however many tensors share it), or None."""


def summarize_tensors(obj: Any, storage_of: StorageOf) -> dict[str, Any]:
    """Tensor count and bytes (each storage counted once), per dtype. Local."""
    count: Counter[str] = Counter()
    storages: dict[str, StorageInfo] = {}
    for t in iter_tensors(obj):
        count[dtype_name(t.dtype)] += 1
        info = storage_of(t)
        if info is not None:
            storages[info.key] = info
    nbytes: Counter[str] = Counter()
    for info in storages.values():
        nbytes[dtype_name(info.dtype)] += info.nbytes
    by_dtype = {d: {"count": count[d], "bytes": nbytes[d]} for d in sorted(count | nbytes)}
    return {"count": sum(count.values()), "bytes": sum(nbytes.values()), "by_dtype": by_dtype}


def loaded_storage_of(tensor: torch.Tensor) -> StorageInfo:
    """A tensor read by a foreign source's reader (memory-mapped, or a meta tensor from a header) as a storage.

    Local. A safetensors file maps one buffer that every tensor views, so a tensor's own span
    (address and size) stands for its storage: tied weights (one span) count once.
    """
    nbytes = tensor.numel() * tensor.element_size()
    key = f"meta:{id(tensor)}" if tensor.is_meta else f"{tensor.device}:{tensor.data_ptr()}:{nbytes}"
    return StorageInfo(key, tensor.dtype, str(tensor.device), tensor.numel(), nbytes, ())


def chain_storage_of(*lookups: StorageOf) -> StorageOf:
    """The first lookup that knows a tensor. Local."""

    def storage_of(tensor: torch.Tensor) -> StorageInfo | None:
        return next((info for look in lookups if (info := look(tensor)) is not None), None)

    return storage_of


def device_tags(*archives: ArchiveContents) -> dict[str, dict[str, int]]:
    """Storages and bytes per saved device tag (``cpu``, ``cuda:3``) over one or more torch archives. Local."""
    tags: dict[str, dict[str, int]] = {}
    for contents in archives:
        for info in contents.storages.values():
            entry = tags.setdefault(info.location, {"storages": 0, "bytes": 0})
            entry["storages"] += 1
            entry["bytes"] += info.nbytes
    return tags


_OPTIMIZER_FILES: Final = ("optimizer.pt", "optimizer.bin")
_WHY: Final = {
    "skipped_files": "never unpickled: only an unsafe unpickler reads it, and resume does not need it",
    "not_read": "not read: resume does not restore it",
    "more_models": "not read: resume restores the first model only",
    "more_optimizers": "not read: resume restores the first optimizer only",
    "more_schedulers": "not read: resume restores the first scheduler only",
}
SOURCE_META_KEYS: Final = frozenset({*_WHY, "files", "source_layout"})  # shown as files / not read, not as meta

TENSOR_DATA_HEADER: Final = "not read (safetensors header only)"
TENSOR_DATA_MMAP: Final = "not read (memory-mapped on the CPU; torch files' structure from their pickles)"
TENSOR_DATA_DCP: Final = "read on the CPU (torch's DCP reader)"


@dataclass(frozen=True)
class ForeignSource:
    """A foreign source as inspect sees it: its parts, files, unread files and where its tensors' bytes are."""

    parts: CheckpointParts
    files: list[dict[str, Any]]
    not_read: list[dict[str, str]]
    tensor_data: str
    storage_of: StorageOf
    device_tags: dict[str, dict[str, int]]


def read_foreign_source(path: Location, layout: Layout) -> ForeignSource:
    """Read ``path`` (a foreign ``layout``) for ``inspect``. Local; see the module docstring for what is read."""
    files: list[dict[str, Any]] = [{"name": f.name, "size": f.stat().st_size} for f in source_files(path)]
    if layout is Layout.SAFETENSORS:
        return ForeignSource(
            _safetensors_parts(local_path(path, "inspect")), files, [], TENSOR_DATA_HEADER, loaded_storage_of, {}
        )
    parts = open_checkpoint(path, map_location="cpu", mmap=True).parts
    if parts is None:  # open_checkpoint yields parts for every foreign source
        raise DistResumeError(f"{str(path)!r} was not read as a {layout.value!r} source")
    not_read = [{"name": name, "why": why} for key, why in _WHY.items() for name in parts.meta.get(key) or ()]
    unread = {entry["name"] for entry in not_read}
    archives: dict[str, ArchiveContents] = {}
    for f in files if layout is not Layout.DCP else ():  # a .distcp file may start like a zip: it is not one
        if f["name"] not in unread and (contents := _archive(path / f["name"])) is not None:
            archives[f["name"]] = contents
    storage_of: StorageOf = loaded_storage_of
    optimizer_file = next((n for n in _OPTIMIZER_FILES if n in archives), None)
    if optimizer_file is not None and parts.optimizer is not None:
        parts = dataclasses.replace(parts, optimizer=archives[optimizer_file].obj)
        storage_of = chain_storage_of(archives[optimizer_file].storage_of, loaded_storage_of)
    # a sharded checkpoint folder is read whole through DCP too (its manifest's CRC-32s checked first)
    tensor_data = TENSOR_DATA_DCP if layout in (Layout.DCP, Layout.SHARDED) else TENSOR_DATA_MMAP
    return ForeignSource(parts, files, not_read, tensor_data, storage_of, device_tags(*archives.values()))


def _archive(path: Path) -> ArchiveContents | None:
    """A torch zip file of the folder read as meta tensors, or None (not a torch file, or not readable so)."""
    if file_kind(path) is not FileKind.ZIP:
        return None
    try:
        return read_archive(path)
    except DistResumeError:  # open_checkpoint read the files resume needs; this one is described by name only
        return None


def _safetensors_parts(path: Path) -> CheckpointParts:
    """A ``.safetensors`` file's weights as meta tensors, from its header alone."""
    _, entries, metadata = read_safetensors_header(path)
    ordered = sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0])
    model = {k: torch.empty(e["shape"], dtype=DTYPES[e["dtype"]], device="meta") for k, e in ordered}
    meta = {"safetensors_metadata": metadata} if metadata else {}
    return CheckpointParts(Layout.SAFETENSORS, model, meta=meta, keys={"model": path.name})


def is_sharded_folder(path: Location) -> bool:
    """Whether ``path`` is (or was meant to be) a sharded checkpoint folder: it has a manifest, or it is named
    ``ckpt_<step>.dcp`` (one without its manifest is a save that never finished). Local."""
    return path.is_dir() and (
        (path / MANIFEST).is_file() or (path.suffix == ".dcp" and bool(CHECKPOINT_NAME.match(path.name)))
    )


def check_sharded(path: Location) -> dict[str, Any] | None:
    """A sharded checkpoint folder checked whole, and what its manifest says; None for any other path. Local.

    Reads every file the manifest lists once (sizes and CRC-32s): a missing manifest, a missing file or one
    whose size or CRC-32 differs raises :class:`CheckpointError` naming the folder and each such file, before
    any of it is read as a checkpoint. The result (``inspect``'s ``sharded``): the world size, device mesh and
    writers the save had, what its DCP state holds, and each writing rank's files with their bytes.
    """
    if not is_sharded_folder(path):
        return None
    manifest, _ = read_manifest(path)  # a folder without one: its save never finished, said so
    verify_source(path)  # every listed file there, with its size and CRC-32, or the files named
    ranks: dict[int, list[Any]] = {}
    for entry in manifest.files:
        ranks.setdefault(entry.rank, []).append(entry)
    shards = sum(1 for f in manifest.files if SHARD_FILE.match(f.name))
    if not shards:
        raise CheckpointCorruptError(
            f"sharded checkpoint {str(path)!r}: its manifest lists no shard file (__<rank>_<n>.distcp); the folder "
            "was assembled by hand: resume from another checkpoint"
        )
    return {
        "step": manifest.step,
        "epoch": manifest.epoch,
        "world_size": manifest.world_size,
        "mesh_shape": None if manifest.mesh_shape is None else list(manifest.mesh_shape),
        "mesh_dim_names": None if manifest.mesh_dim_names is None else list(manifest.mesh_dim_names),
        "writers": manifest.writers,
        "contents": list(manifest.contents),
        "save_id": manifest.save_id,
        "shard_files": shards,
        "ranks": [
            {"rank": r, "files": [f.name for f in files], "bytes": sum(f.size for f in files)}
            for r, files in sorted(ranks.items())
        ],
        "complete": True,  # (else raised above)
        "checked": f"{len(manifest.files)} files, each with the size and CRC-32 its manifest lists",
    }
