"""A snapshot's outcome agreed on by every rank before anything is committed: a failure on any rank (its share of
the copy, its own shards) commits nothing anywhere and is the same error on every rank."""

from __future__ import annotations

from typing import Any

from ..._core.errors import CheckpointWriteError, DistResumeError
from ..._core.rank import global_rank
from ..._dist.agree import first_failure
from ..._dist.comm import Outcome, all_gather_objects, collective_step
from ..._dist.env import is_distributed
from ..._memory import PendingSnapshot
from .commit import Commits
from .split import meet

__all__ = ["agree", "agree_then_commit", "meet_then_commit"]


def agree(error: BaseException | None) -> None:
    """Collective: every rank raises the same error when some rank failed to take the snapshot (the lowest failing
    rank's, its class and attributes, naming every failing rank; a :class:`CheckpointWriteError` for one that is no
    dist_resume error). A peer lost: this rank's own error, else a :class:`CheckpointWriteError`."""
    mine = Outcome() if error is None else Outcome.failed(global_rank(), error)
    try:
        with collective_step("agreeing that every rank took its part of the snapshot", CheckpointWriteError):
            outcomes: list[Outcome] = all_gather_objects(mine)
    except DistResumeError:
        if error is not None:
            raise error from None
        raise
    agreed = first_failure(outcomes, CheckpointWriteError, "could not take the snapshot")
    if agreed is not None:
        raise agreed from error


def agree_then_commit(commits: Commits, error: BaseException | None, pending: PendingSnapshot | None) -> None:
    """FSDP2: every rank learns every rank's outcome, then commits its own part; nothing when any rank failed.
    Collective."""
    try:
        agree(error)
    except BaseException:
        if pending is not None:
            pending.abort()
        raise
    if pending is not None:
        commits.later(pending)


def meet_then_commit(
    commits: Commits, error: BaseException | None, pending: PendingSnapshot | None, group: Any
) -> None:
    """The node's writer commits once the node's ranks (``group``; None: it copied alone) met with no failure; every
    rank agrees on the outcome. Collective under torch.distributed."""
    try:
        if group is not None and meet(error, group) and pending is not None:
            pending.abort()  # another local rank failed its share: its error is agreed on below
        elif pending is not None and error is None:
            commits.later(pending)
        pending = None
    except Exception as err:
        error = error or err
    finally:
        if pending is not None:
            pending.abort()
    if is_distributed():
        agree(error)
    elif error is not None:
        raise error
