"""A snapshot's outcome agreed on by every rank before anything is committed: a failure on any rank (its share of
the copy, its own shards) commits nothing anywhere and is the same error on every rank."""

from __future__ import annotations

from ..._core.errors import CheckpointWriteError, DistResumeError
from ..._core.rank import global_rank
from ..._dist.agree import any_failed, first_failure
from ..._dist.comm import Outcome, all_gather_objects, collective_step
from ..._dist.env import is_distributed
from ..._shm import PendingSnapshot
from .commit import Commits

__all__ = ["agree", "agree_then_commit"]


def agree(error: BaseException | None) -> None:
    """Collective: every rank raises the same error when some rank failed to take the snapshot (the lowest failing
    rank's, its class and attributes, naming every failing rank; a :class:`CheckpointWriteError` for one that is no
    dist_resume error). A peer lost: this rank's own error, else a :class:`CheckpointWriteError`. One process: its own
    error, raised as it is. When no rank failed it costs one all-reduce of one integer; the errors themselves are
    gathered only when some rank failed."""
    if not is_distributed():
        if error is not None:
            raise error
        return
    mine = Outcome() if error is None else Outcome.failed(global_rank(), error)
    try:
        with collective_step("agreeing that every rank took its part of the snapshot", CheckpointWriteError):
            if not any_failed(error is not None):  # nearly always: one integer reduced, no pickle
                return
            outcomes: list[Outcome] = all_gather_objects(mine)
    except DistResumeError:
        if error is not None:
            raise error from None
        raise
    agreed = first_failure(outcomes, CheckpointWriteError, "could not take the snapshot")
    if agreed is not None:
        raise agreed from error


def agree_then_commit(commits: Commits, error: BaseException | None, pending: PendingSnapshot | None) -> None:
    """Every rank learns every rank's outcome (its share of the copy, its own shards, the previous copy's error on
    rank 0), then each writer commits its part; nothing anywhere when any rank failed, and the same error on every
    rank. Collective under torch.distributed (one all-gather: the node's ranks need no meeting of their own)."""
    try:
        agree(error)
    except BaseException:
        if pending is not None:
            pending.abort()
        raise
    if pending is not None:
        commits.later(pending)
