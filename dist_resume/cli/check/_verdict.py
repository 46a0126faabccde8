"""The verdict of ``dist-resume check``: both folders compared pair by pair, the first difference, the diagnosis,
assembled into a :class:`~dist_resume.cli.check._result.ResumeCheck`.

Two cases are not "every pair equal" read plainly. A run whose compared checkpoints were all written before the first
interruption checked nothing: an error (:class:`~dist_resume.errors.CheckCommandError`), not exact. Python's
``random`` and NumPy's global stream differing at *every* compared step while all else is equal is a command that
does not seed them and draws nothing it trains from them: exact, with a note (a restore that went wrong would leave
the checkpoints written before any interruption equal).

Every saved string that names a run's folder is compared with it replaced by ``<run folder>``
(:mod:`._mask`): each run has its own folder, and a script that saves its arguments saves it; a note says where.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

from ..._core.errors import CheckCommandError
from ._compare import EXTRA_PART, UNSEEDED_PART, PairResult, compare_pair, pairs_to_compare, unseeded_said
from ._diagnose import diagnose
from ._evidence import collect_evidence
from ._launch import Launch, stderr_tail
from ._mask import masked_said, masks_for
from ._result import Cause, ResumeCheck, StepDifference

__all__ = ["verdict"]


def _unseeded_note(results: Sequence[PairResult]) -> str:
    names, one, how = unseeded_said(name for r in results for name in r.streams)
    it = "it" if one else "them"
    return (
        f"{names} differ{'s' if one else ''} between the two runs at every step compared while everything the "
        f"training holds is equal: the command does not seed {it} (each process starts {it} from the OS's entropy) "
        f"and nothing it trains draws from {it}; a script that draws from {it} (augmentation, shuffling) must seed "
        f"{it}: dist_resume.seed_rng(seed), or {how}"
    )


def _nothing_checked(launches: Sequence[Launch], results: Sequence[PairResult]) -> CheckCommandError:
    names = ", ".join(r.pair.interrupted.name for r in results)
    stop = launches[0].stopped_at or 0.0
    return CheckCommandError(
        f"no checkpoint was written after a resume: nothing was checked. Every checkpoint compared ({names}) was "
        f"written by the interrupted run's first launch, before its stop at {stop:.1f} s; the relaunch resumed from "
        "the last of them and saved nothing more. Save during the run more often (every N steps, or each epoch), so "
        "that a relaunch has steps left to train and save",
        run=launches[-1].label,
        returncode=launches[-1].returncode,
        stderr=stderr_tail(launches[-1].stderr),
    )


def verdict(
    argv: Sequence[str],
    ref: Launch,
    launches: Sequence[Launch],
    folders: tuple[Path, Path],
    *,
    asked: int,
    signal: str,
    strict_extra: bool = False,
) -> ResumeCheck:
    """Compare the reference's folder with the interrupted run's and say whether the resume is exact. Local.

    ``launches`` are the interrupted run's, in order; exact needs at least one interruption, a last launch that
    succeeded, a compared checkpoint written after a resume, and every pair of checkpoints equal (but for unseeded
    Python and NumPy streams, differing at every pair, and, unless ``strict_extra``, ``extra``: the script's own
    bookkeeping, whose keys that differ the result names). Raises :class:`~dist_resume.errors.CheckCommandError`
    when every compared checkpoint was written before the first interruption and all are equal.
    """
    start = time.monotonic()
    written_by = {seen.name: number for number, run in enumerate(launches, 1) for seen in run.seen}
    root = folders[0].parent if folders[0].parent == folders[1].parent else None
    masks = masks_for(folders, root)
    results = [compare_pair(pair, masks) for pair in pairs_to_compare(*folders)]
    first = next((r for r in results if not r.equal), None)
    interrupts = sum(run.stopped_at is not None for run in launches)
    ok = bool(results) and interrupts > 0 and not launches[-1].failed
    # an unseeded stream differs from the first checkpoint on; what else differs is what the diagnosis reads
    unseeded = bool(results) and all(r.differs(UNSEEDED_PART) for r in results)
    # extra is the script's bookkeeping (args.start_epoch written after a resume): named, not a difference unless strict
    ignored = ({UNSEEDED_PART} if unseeded else set()) | (set() if strict_extra else {EXTRA_PART})
    other = next((r for r in results if any(p.part not in ignored for p in r.parts)), None)
    resumed = any(written_by.get(r.pair.interrupted.name, 0) >= 2 for r in results)
    if ok and other is None and not resumed:
        raise _nothing_checked(launches, results)
    exact = ok and other is None
    causes: tuple[Cause, ...] = ()
    diagnosis = None
    if not exact:
        evidence = collect_evidence(results, other, launches, written_by, unseeded=unseeded, strict_extra=strict_extra)
        causes, diagnosis = diagnose(evidence)
    extra_keys = tuple(dict.fromkeys(key for r in results for key in r.extra_keys)) if exact else ()
    masked = tuple(dict.fromkeys(key for r in results for key in r.masked))
    notes = ((_unseeded_note(results),) if exact and unseeded else ()) + ((masked_said(masked),) if masked else ())
    return ResumeCheck(
        command=tuple(argv),
        exact=exact,
        interrupts=interrupts,
        interrupts_asked=asked,
        signal=signal,
        device=None,
        steps=tuple((r.pair.step, r.equal or (exact and all(p.part in ignored for p in r.parts))) for r in results),
        first_difference=None
        if first is None or exact
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
        notes=notes,
        extra_differs=extra_keys,
    )
