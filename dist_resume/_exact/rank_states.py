"""The per-rank state save_checkpoint gathers on rank 0 (RNG streams, data position), and its merge into a
checkpoint's entries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import StateMismatchError
from .._dist.comm import all_gather_objects
from .._dist.env import is_distributed
from .rng import rng_state_dict
from .stateful_loader import merge_loader_states

__all__ = ["gather_rank_states", "merge_rank_states"]


def gather_rank_states(
    *, rng: bool, sampler: Any = None, device: torch.device | None = None, everywhere: bool = False
) -> list[dict[str, Any]] | None:
    """Every rank's RNG and sampler state, gathered on rank 0 (``None`` on the others; on every rank with
    ``everywhere``: each node's memory snapshot holds every rank's).

    Collective under torch.distributed (one object all-gather): call it on every rank. Local in a
    single process. ``sampler`` is a sampler with ``state_dict()`` or such a state dict itself.
    """
    state = sampler if sampler is None or isinstance(sampler, Mapping) else sampler.state_dict()
    mine = {"rng": rng_state_dict(device) if rng else None, "sampler": None if state is None else dict(state)}
    if not is_distributed():
        return [mine]
    everyone = all_gather_objects(mine)
    return everyone if everywhere or dist.get_rank() == 0 else None


def merge_rank_states(states: list[dict[str, Any]]) -> tuple[list[dict[str, Any]] | None, dict[str, Any] | None]:
    """The checkpoint's RNG list (index = rank) and data position from :func:`gather_rank_states` (with every
    rank's StatefulDataLoader entry under ``"loader"``, when the position is one's).

    Raises :class:`StateMismatchError` when the ranks' samplers disagree on epoch or position.
    """
    rngs = [s["rng"] for s in states]
    samplers = [s["sampler"] for s in states]
    sampler = samplers[0]
    if sampler is not None:
        positions = [(s.get("epoch"), s.get("consumed", s.get("yielded"))) for s in samplers]
        if len(set(positions)) > 1:
            raise StateMismatchError(
                f"the ranks' samplers are at different positions (epoch, samples consumed): "
                f"{positions}; every rank must draw the same number of batches before saving. A DataLoader "
                "with workers prefetches: pass sampler=sampler.state_dict(consumed=<samples trained on>)"
            )
        if "loader" in sampler:  # StatefulDataLoaders: every rank's own state, one list (index = rank)
            entries = merge_loader_states([s["loader"] for s in samplers])
            sampler = {**{k: v for k, v in sampler.items() if k != "loader"}, "loader": entries}
    return (rngs if rngs[0] is not None else None), sampler
