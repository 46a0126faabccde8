"""Walking nested containers of tensors (state dicts, optimizer state, checkpoints) without losing their shape."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["map_tensors", "iter_tensors"]


def map_tensors(obj: Any, fn: Callable[[Any], Any], kind: type = torch.Tensor) -> Any:
    """``obj`` with every tensor (every ``kind`` instance) replaced by ``fn(it)``; dicts keep their type and ``_metadata``."""
    if isinstance(obj, kind):
        return fn(obj)
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for key, value in obj.items():
            out[key] = map_tensors(value, fn, kind)
        meta = getattr(obj, "_metadata", None)
        if meta is not None:
            out._metadata = meta  # type: ignore[attr-defined,union-attr]
        return out
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn, kind) for v in obj)
    return obj


def iter_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``obj``, depth first."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from iter_tensors(value)
