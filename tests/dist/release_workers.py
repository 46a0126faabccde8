"""Rank functions for tests/dist/test_release.py (module level, so forkserver children import them)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from dist_resume._dist.broadcast import broadcast_loaded
from dist_resume._dist.comm import all_gather_objects, broadcast_object, run_on_rank0


def _owned_by_gloo(tensors: list[torch.Tensor]) -> int:
    """How many of the tensors a collective was given are still owned by more than their Python object."""
    return sum(t._use_count() > 1 for t in tensors)  # type: ignore[attr-defined]  # private: not in torch's stubs


def plain_collectives(rank: int, world_size: int, rounds: int) -> int:
    """torch alone: how often gloo's worker still owns a tensor right after a synchronous collective returns."""
    held = 0
    for _ in range(rounds):
        t = torch.ones(4)
        outs = [torch.empty(4) for _ in range(world_size)]
        dist.broadcast(t, src=0)
        held += _owned_by_gloo([t])
        dist.all_gather(outs, t)
        held += _owned_by_gloo([t, *outs])
    return held


@contextmanager
def _recording(given: list[torch.Tensor]) -> Iterator[None]:
    """Record every tensor handed to dist.broadcast / dist.all_gather (recording adds no C++ owner)."""
    broadcast, all_gather = dist.broadcast, dist.all_gather

    def rec_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        given.append(tensor)
        return broadcast(tensor, *args, **kwargs)

    def rec_all_gather(outs: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        given.extend([*outs, tensor])
        return all_gather(outs, tensor, *args, **kwargs)

    dist.broadcast, dist.all_gather = rec_broadcast, rec_all_gather  # type: ignore[assignment]
    try:
        yield
    finally:
        dist.broadcast, dist.all_gather = broadcast, all_gather  # type: ignore[assignment]


def library_collectives(rank: int, world_size: int, rounds: int) -> dict[str, Any]:
    """dist_resume's collectives: the moment each returns, gloo must own none of the tensors it used."""
    payload: dict[str, Any] = {
        "w": torch.arange(300, dtype=torch.float32),
        "b": torch.ones(7, dtype=torch.bfloat16),
        "step": 3,
    }
    calls: dict[str, Callable[[], Any]] = {
        "broadcast_object": lambda: broadcast_object({"step": 5} if rank == 0 else None),
        "all_gather_objects": lambda: all_gather_objects(rank),
        "run_on_rank0": lambda: run_on_rank0(lambda: "written"),
        "broadcast_loaded": lambda: broadcast_loaded(lambda: payload if rank == 0 else None, bucket_bytes=256),
    }
    held = dict.fromkeys(calls, 0)
    given_count = dict.fromkeys(calls, 0)
    for _ in range(rounds):
        for name, call in calls.items():
            given: list[torch.Tensor] = []
            with _recording(given):
                call()
            held[name] += _owned_by_gloo(given)  # checked at once, before anything else runs
            given_count[name] += len(given)
    got = broadcast_loaded(lambda: payload if rank == 0 else None, bucket_bytes=256)
    return {"held": held, "given": given_count, "intact": torch.equal(got["w"], payload["w"])}
