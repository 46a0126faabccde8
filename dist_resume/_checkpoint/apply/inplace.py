"""Writing a checkpoint's data into the live tensors it restores, and cutting state loose from a mapped file."""

from __future__ import annotations

from typing import Any

import torch

from ..._core.tree import iter_tensors

__all__ = ["fits", "storage_ptrs", "detach_from_file"]


def fits(src: Any, dst: Any) -> bool:
    """Whether ``src`` can be copied straight into ``dst`` (tensors of one shape and dtype, ``dst`` contiguous)."""
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and dst.is_contiguous()
    )


def storage_ptrs(obj: Any) -> set[int]:
    """The data pointers of the CPU storages under ``obj``."""
    return {t.untyped_storage().data_ptr() for t in iter_tensors(obj) if t.device.type == "cpu"}


def detach_from_file(optimizer: torch.optim.Optimizer, loaded: set[int]) -> None:
    """Clone state tensors that still alias the memory-mapped checkpoint (CPU params, same dtype)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.untyped_storage().data_ptr() in loaded
            ):
                state[key] = value.clone()
