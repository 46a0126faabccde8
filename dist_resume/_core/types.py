"""Type aliases shared by every layer: paths and ``map_location`` values as torch accepts them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypeAlias

import torch

__all__ = ["PathLike", "MapLocation"]

PathLike: TypeAlias = str | os.PathLike[str]
MapLocation: TypeAlias = str | int | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any] | None
