"""An asynchronous save's staging: the state copied into private CPU tensors before a thread writes it, into the
previous save's buffers where shapes and dtypes match (no allocation of the whole state per save), through pinned host
memory for an accelerator's tensors where the backend supports it."""

from __future__ import annotations

from typing import Any

import torch

from .._core.tree import map_tensors
from .._dist.accelerator import pinned_staging

__all__ = ["stage"]

_buffers: list[torch.Tensor] = []  # the previous snapshot's tensors; free once its write is done


def stage(obj: Any) -> tuple[Any, set[torch.device]]:
    """A copy of ``obj`` whose tensors are private CPU copies, written into the previous snapshot's tensors
    where shapes and dtypes match (the previous write is over by now); and the devices it copied from
    without blocking. An accelerator tensor is staged through pinned host memory where the backend
    supports it (:func:`~dist_resume._dist.accelerator.pinned_staging`), with a plain CPU copy otherwise."""
    old = list(_buffers)
    _buffers.clear()
    queued: set[torch.device] = set()

    def copy(t: torch.Tensor) -> torch.Tensor:
        src = t.detach()
        i = len(_buffers)
        pinned = src.device.type != "cpu" and pinned_staging(src.device.type)
        out = old[i] if i < len(old) else None
        if out is None or out.shape != src.shape or out.dtype != src.dtype or out.is_pinned() != pinned:
            out = torch.empty(src.shape, dtype=src.dtype, pin_memory=pinned)
        out.copy_(src, non_blocking=pinned)
        if pinned:
            queued.add(src.device)
        _buffers.append(out)
        return out

    return map_tensors(obj, copy), queued
