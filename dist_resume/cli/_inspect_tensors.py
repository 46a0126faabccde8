"""How ``dist-resume inspect`` counts tensors and bytes, whether they were read as meta tensors or memory-mapped."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

from .._core.tree import iter_tensors
from .._format.archive import ArchiveContents, StorageInfo
from ._common import dtype_name

__all__ = ["StorageOf", "summarize_tensors", "loaded_storage_of", "chain_storage_of", "device_tags"]

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
