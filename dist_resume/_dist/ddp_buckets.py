"""A DDP resume reduces its first step in the uninterrupted run's bucket layout, so it stays bitwise past 2 ranks.

A new ``DistributedDataParallel`` reduces its first iteration in one bucket and rebuilds its buckets at the next
forward (FACTS 42): an uninterrupted run's step ``k + 1`` is on the rebuilt buckets, a run resumed at ``k`` reduces
that step in one bucket, and past 2 ranks a ring all-reduce then adds each element in another order. A save records
the layout the DDP reduces in (``meta["ddp_buckets"]``: each bucket's parameter indices, checked where every
``meta`` entry is, :func:`dist_resume._layout.meta.toolkit_meta`); a resume gives the live
DDP, before its first forward, a reducer with that layout (:func:`dist_resume._core.torch_compat.ddp.install_layout`). Its
first step then reduces every element in the same order as the uninterrupted run's, and at the next forward it
rebuilds from its own gradient-ready order, which is the uninterrupted run's (FACTS 47).

Every rank installs the layout or none does (one all-gather of each rank's decision): a layout on some ranks only
would make the ranks' bucket all-reduces differ in size.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist
from torch import nn

from .._core.log import log_rank0
from .._core.torch_compat.ddp import (
    BucketLayout,
    bucket_layout_of,
    ddp_started,
    find_ddp,
    install_layout,
    reduced_parameters,
    unsupported_reason,
)
from .comm import all_gather_objects

__all__ = ["saved_layout", "replay_layout", "not_replayed"]

_NOT_REPLAYED = "_dist_resume_layout_not_replayed"  # on a DDP whose resume could not replay the saved layout: why


def saved_layout(model: nn.Module) -> list[list[int]] | None:
    """What a save records for ``model`` under ``meta["ddp_buckets"]``: the layout its DDP reduces in, or None (not
    DDP, or not rebuilt yet: its next step is a first step in one bucket, as a resumed DDP's). Local."""
    ddp = find_ddp(model)
    layout = None if ddp is None else bucket_layout_of(ddp)
    return None if layout is None else [list(bucket) for bucket in layout]


def replay_layout(model: nn.Module, layout: BucketLayout | None) -> bool:
    """Give ``model``'s DDP the saved bucket ``layout`` before its first step; whether it did.

    Collective when ``model`` is (or wraps) a ``DistributedDataParallel`` and ``layout`` is not None (every rank
    installs it or none does); local and a no-op otherwise. When it cannot (the DDP already ran a forward pass, another
    parameter count, a built-in comm hook, ...), the first step after the resume reduces in one bucket as any new DDP
    does: rank 0 says why once (WARNING past 2 ranks, where it changes the sums' last bits).
    """
    ddp = find_ddp(model)
    if ddp is None or layout is None:
        return False
    reason = _local_reason(ddp, layout)
    decisions = all_gather_objects((layout, reason), group=ddp.process_group)
    reasons = [f"rank {rank}: {why}" for rank, (_, why) in enumerate(decisions) if why is not None]
    if not reasons and any(saved != layout for saved, _ in decisions):
        reasons = ["the ranks read different layouts"]
    if reasons:
        setattr(ddp, _NOT_REPLAYED, "; ".join(reasons))  # what its next saves record, for dist-resume check
        world = dist.get_world_size(ddp.process_group)
        log_rank0(
            logging.WARNING if world > 2 else logging.INFO,
            "DDP's first step after this resume reduces its gradients in one bucket, not in the layout the saved run "
            "reduced in (%s): at %d ranks its sums can differ from an uninterrupted run's in their last bits "
            "(docs/exact-resume.md#ddp-buckets)",
            "; ".join(reasons),
            world,
        )
        return False
    install_layout(ddp, layout)
    return True


def not_replayed(model: nn.Module) -> str | None:
    """Why the resume of ``model``'s DDP could not replay the saved bucket layout, or None (replayed, nothing to replay,
    or no DDP). Local."""
    ddp = find_ddp(model)
    reason = None if ddp is None else getattr(ddp, _NOT_REPLAYED, None)
    return reason if isinstance(reason, str) else None


def _local_reason(ddp: Any, layout: BucketLayout) -> str | None:
    if ddp_started(ddp):
        return "the DDP model ran a forward pass before the resume; resume before training"
    unsupported = unsupported_reason(ddp)
    if unsupported is not None:
        return unsupported
    count = len(reduced_parameters(ddp))
    saved = sum(len(bucket) for bucket in layout)
    if saved != count:
        return f"the checkpoint's layout has {saved} parameters, this DDP reduces {count}"
    return None
