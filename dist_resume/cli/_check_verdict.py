"""The verdict of ``dist-resume check``: both folders compared pair by pair, the first difference, the diagnosis,
assembled into a :class:`~dist_resume.cli._check_result.ResumeCheck`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ._check_compare import compare_pair, pairs_to_compare
from ._check_diagnose import Evidence, diagnose
from ._check_result import ResumeCheck, StepDifference
from ._check_run import Launch

__all__ = ["verdict"]


def verdict(
    argv: Sequence[str],
    ref: Launch,
    launches: Sequence[Launch],
    folders: tuple[Path, Path],
    *,
    asked: int,
    signal: str,
) -> ResumeCheck:
    """Compare the reference's folder with the interrupted run's and say whether the resume is exact. Local.

    ``launches`` are the interrupted run's, in order; exact needs at least one interruption, a last launch that
    succeeded, and every pair of checkpoints equal.
    """
    start = time.monotonic()
    written_by = {seen.name: number for number, run in enumerate(launches, 1) for seen in run.seen}
    results = [compare_pair(pair) for pair in pairs_to_compare(*folders)]
    first = next((r for r in results if not r.equal), None)
    interrupts = sum(run.stopped_at is not None for run in launches)
    ok = bool(results) and interrupts > 0 and not launches[-1].failed
    causes, diagnosis = diagnose(Evidence(results, first, launches, written_by))
    return ResumeCheck(
        command=tuple(argv),
        exact=ok and first is None,
        interrupts=interrupts,
        interrupts_asked=asked,
        signal=signal,
        device=None,
        steps=tuple((r.pair.step, r.equal) for r in results),
        first_difference=None
        if first is None
        else StepDifference(
            first.pair.step,
            first.pair.reference.name,
            first.pair.interrupted.name,
            written_by.get(first.pair.interrupted.name),
            first.parts,
        ),
        hyperparameters=tuple(h for r in results for h in r.hyperparameters),
        causes=causes,
        diagnosis=diagnosis,
        reference=ref,
        launches=tuple(launches),
        wall_seconds=0.0,
        compare_seconds=round(time.monotonic() - start, 3),
    )
