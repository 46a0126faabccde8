"""Where resume's checkpoint comes from: a file or folder read on every rank, or read on rank 0 and broadcast."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .._core.errors import CheckpointNotFoundError
from .._core.types import PathLike
from .._dist.broadcast import DEFAULT_BUCKET_BYTES, broadcast_loaded
from .._format.load import load_checkpoint
from .folder import latest_checkpoint

__all__ = ["load_broadcast"]


def load_broadcast(
    path: PathLike,
    *,
    mmap: bool,
    weights_only: bool,
    verify: bool,
    prepare: Callable[[Path, Any], dict[int, torch.Tensor]] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[Path, Any]:
    """Global rank 0 picks and reads the checkpoint (a file, or a folder's newest valid one); all ranks get it.

    Collective. Only rank 0 touches the filesystem, so the other ranks need not see the file.
    """

    def load() -> tuple[str, Any]:
        chosen = Path(path)
        if chosen.is_dir():
            latest = latest_checkpoint(chosen, verify=True)
            if latest is None:
                raise CheckpointNotFoundError(f"no complete checkpoint in folder {str(chosen)!r} (seen from rank 0)")
            chosen = latest
        obj = load_checkpoint(chosen, map_location="cpu", mmap=mmap, weights_only=weights_only, verify=verify)
        return str(chosen), obj

    def prepare_pair(view: Any) -> dict[int, torch.Tensor]:
        return prepare(Path(view[0]), view[1]) if prepare is not None else {}

    chosen, obj = broadcast_loaded(load, bucket_bytes=bucket_bytes, prepare=prepare_pair)
    return Path(chosen), obj
