"""Optimizer state for FSDP2 parameters, from full (unsharded) saved state: each rank keeps its boxes.

Adam's ``exp_avg``/``exp_avg_sq`` and SGD's ``momentum_buffer`` of a DTensor parameter are DTensors with
the parameter's mesh and placements; ``step`` is a plain scalar tensor (on the CPU unless the group is
fused or capturable, torch's policy). :func:`sharded_optimizer_state` turns state prepared by
:func:`~.prepare.prepare_optimizer_state` (matched by name and position, shapes checked against the full
parameters) into a state dict that plain ``Optimizer.load_state_dict`` accepts: each full state tensor
is replaced by a DTensor destination, the live state tensor where one exists (filled in place), else a
new one built from a local tensor of this rank's box (``DTensor.from_local(..., run_check=False)``).
The returned pairs say what to copy where; :func:`load_full_optimizer_state` copies locally, rank 0's
scatter (:mod:`dist_resume._dist.shard_comm`) fills the same pairs from one reader.

Torch's own ``set_optimizer_state_dict`` is not used: given integer-keyed state with
``broadcast_from_rank0`` it restores nothing and says nothing (FACTS 33).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..._core.errors import OptimizerStateMismatchError
from ..._core.shards import is_dtensor, local_of, shard_spec
from ..sharded import copy_full_into

__all__ = ["sharded_optimizer_state", "load_full_optimizer_state"]


def sharded_optimizer_state(
    optimizer: torch.optim.Optimizer, prepared: Mapping[str, Any], *, source: str = "checkpoint"
) -> tuple[dict[str, Any], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``(state dict to load, [(saved full tensor, destination), ...])`` for an optimizer over DTensor parameters.

    Local; the optimizer is not changed (new destinations are allocated, this rank's box only, their
    data not yet written). ``prepared`` comes from :func:`~.prepare.prepare_optimizer_state`: its groups list the
    saved ids in the live parameters' order. Every saved tensor gets a destination, so that filling them
    all (:func:`copy_full_into` on every rank, or rank 0's scatter, where the other ranks hold only meta
    stand-ins) restores everything and nothing maps the checkpoint file: scalar state (``step``) and the
    state of parameters FSDP2 left whole get a plain CPU tensor (or their live twin), state shaped like
    its DTensor parameter a DTensor. Then ``optimizer.load_state_dict(state_dict)``: torch keeps the
    DTensors as they are. A state tensor of another shape than its DTensor parameter cannot be sharded
    like it and raises :class:`OptimizerStateMismatchError`.
    """
    saved_ids = [sid for group in prepared["param_groups"] for sid in group["params"]]
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    state: dict[Any, Any] = {}
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for sid, param in zip(saved_ids, live_params):
        entry = prepared["state"].get(sid)
        if not entry:
            continue
        live = optimizer.state.get(param, {})
        state[sid] = {
            key: _destination(param, key, value, live.get(key), pairs, source) for key, value in entry.items()
        }
    return {**prepared, "state": state}, pairs


def _destination(
    param: torch.Tensor,
    key: str,
    value: Any,
    live: Any,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    source: str,
) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if not is_dtensor(param) or value.dim() == 0:  # step; state of a parameter FSDP2 left whole
        if (
            isinstance(live, torch.Tensor)
            and live.shape == value.shape
            and live.dtype == value.dtype
            and live.is_contiguous()
        ):
            dst = live
        else:  # on the CPU: Optimizer.load_state_dict then places it (step stays there unless fused/capturable)
            dst = torch.empty(value.shape, dtype=value.dtype)
        pairs.append((value, dst))
        return dst
    if tuple(value.shape) != tuple(param.shape):
        raise OptimizerStateMismatchError(
            f"{source}: optimizer state {key!r} has shape {tuple(value.shape)}, its FSDP2 parameter "
            f"{tuple(param.shape)}: only state shaped like its parameter can be sharded with it; restore this "
            "optimizer into an unsharded model, or start its state afresh (allow_missing=('optimizer',))"
        )
    from torch.distributed.tensor import DTensor

    dtype = param.dtype if param.is_floating_point() else value.dtype  # Optimizer.load_state_dict's policy
    spec = shard_spec(param)
    if (
        is_dtensor(live)
        and live.dtype == dtype
        and tuple(live.shape) == spec.global_shape
        and tuple(live.placements) == spec.placements
        and shard_spec(live).mesh == spec.mesh
        and local_of(live).is_contiguous()
    ):
        dst = live
    else:
        local = torch.empty(spec.local_shape, dtype=dtype, device=local_of(param).device)
        dst = DTensor.from_local(
            local, spec.mesh, spec.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    pairs.append((value, dst))
    return dst


def load_full_optimizer_state(
    optimizer: torch.optim.Optimizer, prepared: Mapping[str, Any], *, source: str = "checkpoint"
) -> None:
    """Load full (unsharded) optimizer state into an optimizer over FSDP2 parameters. Local.

    Every rank calls it with the same ``prepared`` state (from :func:`~.prepare.prepare_optimizer_state`; its
    tensors may map the checkpoint file) and keeps only its boxes: existing state tensors are written
    in place, missing ones are allocated at this rank's shard size.

    Example::

        >>> model = torch.nn.Linear(2, 2)  # an FSDP2 model in real use; a plain one passes through
        >>> opt = torch.optim.AdamW(model.named_parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> load_full_optimizer_state(opt, prepare_optimizer_state(opt.state_dict(), opt, model))
    """
    state_dict, pairs = sharded_optimizer_state(optimizer, prepared, source=source)
    for full, dst in pairs:
        copy_full_into(dst, full)
    optimizer.load_state_dict(state_dict)
