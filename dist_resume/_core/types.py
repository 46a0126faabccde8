"""Type aliases shared by every layer: paths (local, or a :class:`~dist_resume._core.location.RemotePath` on an object
store) and ``map_location`` values as torch accepts them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

from .location import RemotePath

__all__ = ["PathLike", "MapLocation"]

PathLike: TypeAlias = str | os.PathLike[str] | RemotePath
if TYPE_CHECKING:
    import torch

    MapLocation: TypeAlias = (
        str | int | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any] | None
    )
else:

    def __getattr__(name: str) -> Any:
        # MapLocation names torch's types: built on first use, so that the torch-free modules that need only
        # PathLike (the zip records, the manifest: what `dist-resume list` reads) do not import torch
        if name != "MapLocation":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        import torch

        alias = str | int | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any] | None
        globals()["MapLocation"] = alias
        return alias
