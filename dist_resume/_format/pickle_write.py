"""Pickling a checkpoint's structure as ``torch.save`` does, with its storages named by persistent ids.

:func:`dump_pickle` pickles a structure whose tensors are meta tensors (from :func:`read_archive`, or
made by a writer) into a ``data.pkl`` that points at storage records by key: the same protocol, the
same rebuild functions, the same persistent ids as ``torch.save``, so ``torch.load(weights_only=True)``
reads it as if torch had written it. No tensor byte is touched.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from .._core.errors import NotACheckpointError
from .._core.torch_compat.private import tensor_reduction
from .archive import ArchiveContents

__all__ = ["dump_pickle"]


class _StorageRef:
    """Pickled as the persistent id of a saved storage, so the new data.pkl points at its record."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _MetaPickler(pickle.Pickler):
    """Pickles a structure of meta tensors the way ``torch.save`` pickles the real one."""

    def __init__(self, file: io.BytesIO, contents: ArchiveContents) -> None:
        super().__init__(file, protocol=2)  # torch.save's default protocol
        self._contents = contents

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageRef else None

    def reducer_override(self, obj: Any) -> Any:
        # Parameters reduce to _rebuild_parameter(param.data, ...), and param.data comes back here
        if not isinstance(obj, torch.Tensor) or type(obj) is torch.nn.Parameter:
            return NotImplemented
        info = self._contents.storage_of(obj)
        if info is None:
            return NotImplemented  # saved without storage (a meta tensor): torch's own reduction is right
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise NotACheckpointError(f"cannot rewrite a {obj.layout} tensor without loading it")
        return tensor_reduction(obj, _StorageRef(info.pid), info.dtype)


def dump_pickle(obj: Any, contents: ArchiveContents) -> bytes:
    """Pickle ``obj`` (its tensors meta tensors registered in ``contents``) as a ``data.pkl``. Local."""
    buf = io.BytesIO()
    _MetaPickler(buf, contents).dump(obj)
    return buf.getvalue()
