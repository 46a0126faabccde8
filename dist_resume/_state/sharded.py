"""FSDP2 models (``fully_shard``, DTensor parameters): what is sharded, and full tensors copied into the shards.

A checkpoint saved from a plain or DDP model holds each tensor whole. Restoring it into an FSDP2
model copies, on every rank, only that rank's box of each full tensor into the parameter's local
shard, in place (``local.copy_(full[box])``): when the full tensor maps the file (``torch.load(mmap=
True)``) the rest of it is never read, and nothing is allocated but what FSDP2 already holds.

Local: nothing here talks to other ranks. Rank 0 sending each rank its boxes is
:mod:`dist_resume._dist.shard_comm`'s; the optimizer's state is :mod:`.optim.sharded`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from .._core.errors import OptimizerStateMismatchError, StateMismatchError
from .._core.shards import ShardSpec, is_dtensor, local_of, shard_spec
from .prefix import DDP_PREFIX, unwrap_model, without_compile, wrapper_prefix

__all__ = [
    "is_sharded",
    "sharded_parameters",
    "check_optimizer_follows",
    "copy_full_into",
    "model_destinations",
    "load_full_model_state",
]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2: any parameter is a DTensor. Local.

    Works through ``torch.compile`` and at any nesting of ``fully_shard`` (per layer, or the root
    only). A sharded model inside DistributedDataParallel/DataParallel raises
    :class:`StateMismatchError`: FSDP2 replaces DDP, it does not run inside it.
    """
    if not any(is_dtensor(p) for p in model.parameters()):
        return False
    if DDP_PREFIX in wrapper_prefix(model):
        raise StateMismatchError(
            f"{type(unwrap_model(model)).__name__} holds FSDP2-sharded (DTensor) parameters but is wrapped in "
            "DistributedDataParallel/DataParallel; FSDP2 does the data-parallel work itself: pass the fully_shard "
            "model without the DDP wrapper (use fully_shard's 2-D HSDP mesh to replicate across groups)"
        )
    return True


def sharded_parameters(model: nn.Module) -> dict[str, ShardSpec]:
    """``{canonical name: ShardSpec}`` for each DTensor parameter (global shape, dtype, mesh, placements, this
    rank's offset and local shape). Local. Names are the unwrapped model's (no ``module.``/``_orig_mod.``)."""
    return {without_compile(name): shard_spec(p) for name, p in unwrap_model(model).named_parameters() if is_dtensor(p)}


def check_optimizer_follows(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raise :class:`OptimizerStateMismatchError` when ``optimizer`` holds none of the FSDP2 ``model``'s parameters.

    Local. ``fully_shard`` replaces each parameter by a new DTensor one: an optimizer built before it
    holds the old tensors, would be given state for tensors no forward uses, and would train nothing.
    """
    own = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if held and not any(id(p) in own for p in held):
        raise OptimizerStateMismatchError(
            f"the {type(optimizer).__name__} holds none of the FSDP2 model's parameters ({len(held)} tensors, "
            f"{sum(is_dtensor(p) for p in held)} of them DTensors): fully_shard replaced the parameters after the "
            "optimizer was built; build the optimizer after fully_shard(model)"
        )


def copy_full_into(dst: torch.Tensor, full: torch.Tensor) -> None:
    """Copy this rank's part of the full tensor ``full`` into ``dst`` in place. Local.

    A DTensor ``dst`` gets its box (``full`` indexed by :meth:`ShardSpec.slices`, a view: a memory-mapped
    ``full`` is read only there); a plain ``dst`` gets all of ``full``. dtype converts as ``copy_`` does.
    """
    if is_dtensor(full):
        raise StateMismatchError(
            "the tensor to copy into a shard is itself a DTensor, not a full tensor; pass the checkpoint's tensors "
            "(DSD's set_model_state_dict(full_state_dict=True) replaces the entries of the dict it is given with "
            "the model's DTensors: give it a copy)"
        )
    if tuple(full.shape) != tuple(dst.shape):
        raise StateMismatchError(f"cannot copy a tensor of shape {tuple(full.shape)} into one of {tuple(dst.shape)}")
    with torch.no_grad():
        if is_dtensor(dst):
            local = local_of(dst)
            if local.numel():
                local.copy_(full[shard_spec(dst).slices()])
        else:
            dst.copy_(full)


def model_destinations(model: nn.Module, state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(key, saved full tensor, live tensor)`` for each tensor of ``state`` (keyed as ``model.state_dict()``).

    Local; changes nothing. The live tensor is the parameter or buffer itself (a DTensor where FSDP2
    sharded it), in ``state``'s order, so every rank lists the same keys in the same order. Raises
    :class:`StateMismatchError` for a key the model lacks or a shape that differs (the plan checked both).
    """
    live = model.state_dict(keep_vars=True)
    out = []
    for key, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        dst = live.get(key)
        if not isinstance(dst, torch.Tensor) or tuple(dst.shape) != tuple(value.shape):
            found = "no such entry" if not isinstance(dst, torch.Tensor) else f"shape {tuple(dst.shape)}"
            raise StateMismatchError(
                f"model entry {key!r}: the checkpoint's tensor has shape {tuple(value.shape)}, the model has {found}; "
                "restore through resume(), which re-keys and checks the checkpoint first"
            )
        out.append((key, value, dst.detach()))
    return out


def load_full_model_state(model: nn.Module, state: Mapping[str, Any]) -> int:
    """Copy a full (unsharded) state dict into an FSDP2 model in place; return how many tensors were copied.

    Local: every rank calls it with the same ``state`` (e.g. each memory-maps the file) and copies its
    own boxes. ``state`` is keyed as ``model.state_dict()`` (re-key first: :func:`adapt_state_dict`);
    entries it lacks are left as they are. Non-tensor entries (``_extra_state``) go to their module's
    ``set_extra_state``. Nothing is allocated: growth of anonymous memory is nil.
    """
    pairs = model_destinations(model, state)
    for _, full, dst in pairs:
        copy_full_into(dst, full)
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) and key.rpartition(".")[2] == "_extra_state":
            model.get_submodule(key.rpartition(".")[0]).set_extra_state(value)
    return len(pairs)
