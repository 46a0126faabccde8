"""``save(step)`` after ``snapshot(step)``: the snapshot's bytes reach the folder only when the live state is shown
unchanged since (:mod:`.evidence`); otherwise the live state is saved, and the snapshot of ``step`` is retired first,
on every node, so that nothing (a resume from memory, ``close()``, the copy at an unplanned end) can later take its
stale bytes for the state of ``step``."""

from __future__ import annotations

from typing import Any

from ..._checkpoint.objects import LiveObjects
from ..._core.log import logger
from ..._shm import retire_snapshot
from ..._shm.slots import mapped
from .commit import Commits
from .evidence import Evidence, changed_since

__all__ = ["still_live", "retire_step"]


def still_live(evidence: Evidence | None, step: int, written: dict[str, Any], live: LiveObjects) -> bool:
    """Whether the snapshot of ``step`` this process wrote (``evidence``) holds what ``written`` (its file's object,
    built now from ``live``) holds. Local; says why not in a DEBUG line."""
    if evidence is None or evidence.step != step:
        why = "it was saved whole (torch.save)" if evidence is None else f"the newest written is of {evidence.step}"
    else:
        found = changed_since(evidence, written, mapped(evidence.path, evidence.laid.layout.size), live)
        if found is None:
            return True
        why = f"the live state changed since: {found}"
    logger.debug("save(step=%d) saves the live state, not the snapshot of that step (%s)", step, why)
    return False


def retire_step(commits: Commits, step: int) -> None:
    """Retire this process's newest snapshot when it is of ``step`` (its commit waited for first): a live save of
    ``step`` supersedes it. Local."""
    commits.join(raising=False)
    newest = commits.newest
    if newest is not None and newest.step == step:
        retire_snapshot(newest)
        commits.newest = None
