"""Writing a checkpoint's data into the live tensors it restores, and cutting state loose from a mapped file."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .._core.tree import iter_tensors

__all__ = ["fits", "live_twins", "into_live_state", "storage_ptrs", "detach_from_file"]


def fits(src: Any, dst: Any) -> bool:
    """Whether ``src`` can be copied straight into ``dst`` (tensors of one shape and dtype, ``dst`` contiguous)."""
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and dst.is_contiguous()
    )


def live_twins(
    optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]
) -> Iterator[tuple[Any, str, torch.Tensor, torch.Tensor]]:
    """``(saved id, key, saved tensor, live tensor)`` for each saved state tensor whose live counterpart (same
    parameter and key) already exists with the same shape and dtype. ``opt_sd`` comes from prepare_optimizer_state."""
    saved_ids = [i for group in opt_sd["param_groups"] for i in group["params"]]
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    for sid, param in zip(saved_ids, live_params):
        live_state = optimizer.state.get(param, {})
        for key, value in (opt_sd["state"].get(sid) or {}).items():
            dst = live_state.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(dst, torch.Tensor)
                and dst.shape == value.shape
                and dst.dtype == value.dtype
            ):
                yield sid, key, value, dst


def into_live_state(optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]) -> dict[str, Any]:
    """``opt_sd`` with each saved state tensor that has a live twin copied into that twin and replaced by it:
    torch's load_state_dict then keeps it as it is. Data that arrived in the twin itself is not copied."""
    state = {sid: dict(entries) for sid, entries in opt_sd["state"].items()}
    with torch.no_grad():
        for sid, key, value, dst in live_twins(optimizer, opt_sd):
            if value is not dst:
                dst.copy_(value)
            state[sid][key] = dst
    return {**opt_sd, "state": state}


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
