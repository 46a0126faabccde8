"""Ranks agreeing on one outcome: every rank learns every rank's success or failure, and all raise the same error."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError, DistResumeError, StateMismatchError
from .comm import Outcome, all_gather_objects, collective_step, comm_device, relabel, released_by_backend

__all__ = ["agree_across_ranks", "gather_agreed", "first_failure", "any_failed"]


def any_failed(failed: bool, group: Any = None) -> bool:
    """Collective (one all-reduce of one integer, on ``group``; None: the default one): whether any rank passed
    ``failed``. The cheap first half of an agreement whose outcome is nearly always a success: the ranks exchange
    their errors (:func:`all_gather_objects`, two collectives and a pickle) only when one failed. A torch.distributed
    failure raises ``RuntimeError``: call it inside :func:`~.comm.collective_step`."""
    flag = torch.tensor([int(failed)], dtype=torch.int32, device=comm_device(group))
    with released_by_backend(flag):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def gather_agreed(
    error: BaseException | None,
    value: Any = None,
    *,
    what: str,
    fallback: type[DistResumeError] = StateMismatchError,
) -> list[Any]:
    """Collective: share each rank's outcome (``error``, or ``value``); every rank's value, in rank order, when none
    failed.

    When some rank failed, a rank passing its own ``error`` returns ``[]`` (its caller raises that) and every other
    rank raises the lowest failing rank's error: the same class with its attributes (``missing``, ``hint``, ...) and
    ``rank`` set, its message naming every failing rank and ``what`` (``fallback``, chained to the original, for an
    exception that is no dist_resume error). Losing a peer raises :class:`CheckpointError` (on a rank that failed
    itself, the caller's own error comes first).
    """
    rank = dist.get_rank()
    mine = Outcome(value=value) if error is None else Outcome.failed(rank, error)
    try:
        with collective_step(f"agreeing that every rank can restore {what}", CheckpointError):
            outcomes: list[Outcome] = all_gather_objects(mine)
    except DistResumeError:
        if error is not None:
            return []  # this rank's own failure says more; its caller raises it
        raise
    err = first_failure(outcomes, fallback, what)
    if err is None:
        return [o.value for o in outcomes]
    if error is None:
        raise err
    return []


def agree_across_ranks(
    error: BaseException | None,
    *,
    what: str = "could not restore the broadcast checkpoint, so nothing was restored on any rank",
    fallback: type[DistResumeError] = StateMismatchError,
) -> None:
    """Collective: share each rank's outcome; raise on every rank if any rank failed (see :func:`gather_agreed`).

    A rank passing its own ``error`` returns (its caller raises that). Every other rank raises the lowest failing
    rank's error, relayed with ``rank`` set.
    """
    gather_agreed(error, what=what, fallback=fallback)


def first_failure(outcomes: list[Outcome], fallback: type[DistResumeError], what: str) -> DistResumeError | None:
    """The error every rank raises when some of ``outcomes`` (one per rank) failed, else None. Local.

    The lowest failing rank's error (its class and attributes, ``rank`` set; ``fallback`` for one that is no
    dist_resume error), its message naming every failing rank: ``rank(s) [1, 3] <what>; rank 1: <its message>``.
    """
    failed = [o.error for o in outcomes if o.error is not None]
    if not failed:
        return None
    first = failed[0]
    err = first.rebuild(fallback)
    message = first.message if type(err).__qualname__ == first.class_name else str(err)
    return relabel(err, f"rank(s) {[f.rank for f in failed]} {what}; rank {first.rank}: {message}")
