"""The causes ``dist-resume check`` reads at the first checkpoint that differs and was written after a resume
(every checkpoint before it is equal): how far apart each rank's RNG streams are there, and how far apart the data
positions. Each rule returns its cause with the evidence in its sentence (the part, the step, the numbers), or None.

What the numbers tell apart (:mod:`._streams`): a resumed run whose torch stream is 2 draws ahead made one
64-bit draw more (a ``DataLoader`` without ``generator=`` creating one more iterator); ahead by more, it drew again
something the saved streams had drawn already (a batch drawn ahead of the save); behind on some ranks only, the
uninterrupted run drew more there (an evaluation on rank 0 between a save and the next step); behind on every rank,
either that on every rank or streams seeded afresh; no distance within reach, the streams were not restored. A data
position one step's samples ahead: the batch drawn before the save was skipped.
"""

from __future__ import annotations

from typing import Final

from ..._core.text import preview
from ._compare import UNSEEDED_PART, UNSEEDED_STREAMS
from ._evidence import Evidence, sample_index, samples_per_step, where
from ._result import Cause
from ._streams import WORDS, RankStreams

__all__ = ["rng_after_resume", "data_position_after_resume"]

Found = tuple[Cause, str]
_LOADER_DRAW: Final = 2  # a DataLoader's new iterator draws one int64 from the global stream: two 32-bit draws
_FIX_HELD: Final = (
    "draw each batch after the save (at the top of the step that trains it), or save the batch held (mgr.save(step, "
    "extra={'batch': batch})) and train it first after a resume"
)
_FIX_SOME_RANKS: Final = (
    "keep such work off the training streams: run it under torch.random.fork_rng(), or give it a torch.Generator of "
    "its own, or do it before the save"
)


def _draws(n: int) -> str:
    return f"{abs(n)} draw{'s' if abs(n) != 1 else ''} (32-bit) {'ahead of' if n > 0 else 'behind'}"


def _rank_said(r: RankStreams, ignored: set[str]) -> str:
    said = []
    for name in (n for n in r.differ if n not in ignored):
        shift = r.shifts.get(name, 0)
        if name not in r.shifts:
            said.append(f"rank {r.rank}'s {name} stream differs")
        elif shift is None:
            said.append(f"rank {r.rank}'s {name} stream is not the reference's within {WORDS:,} draws either way")
        else:
            said.append(f"rank {r.rank}'s {name} stream is {_draws(shift)} the reference's")
    return ", ".join(said)


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {preview(ranks, 4, quote=False)}"


def rng_after_resume(ev: Evidence) -> Found | None:
    """The RNG streams differ at the first checkpoint written after a resume: named by how far apart they are."""
    after = ev.after
    if after is None or not (after.differs("rng") or (not ev.unseeded and after.differs(UNSEEDED_PART))):
        return None
    at = where(ev, after)
    ignored = set(UNSEEDED_STREAMS) if ev.unseeded else set()
    ranks = [r for r in ev.streams if set(r.differ) - ignored]
    measured = [s for r in ranks for name, s in r.shifts.items() if name not in ignored]
    equal = [r.rank for r in ev.streams if r not in ranks]
    if not ranks or (not equal and len(measured) < sum(len(set(r.differ) - ignored) for r in ranks)):
        return Cause.RNG_AFTER_RESUME, (  # a stream whose distance is not measured
            f"the RNG streams differ at {at}: they were not restored, or something drew from them a different number "
            "of times after the resume (the check measures how far apart they are for torch's CPU stream and "
            "Python's only, in the toolkit's per-rank form); resume with the RNG streams (dist_resume's default)"
        )
    evidence = ", ".join(_rank_said(r, ignored) for r in ranks) + (
        f", while the streams of {_ranks(equal)} are equal" if equal else ""
    )
    said = f"the RNG streams differ at {at}: {evidence}"
    shifts = [s for s in measured if s is not None]
    if len(shifts) < len(measured):
        return Cause.RNG_AFTER_RESUME, (
            f"{said}; they are not one stream at two places, so they were not restored (ResumeOptions(rng=False), a "
            "checkpoint saved without them, or streams seeded again after resume()); resume with the RNG streams "
            "(dist_resume's default)"
        )
    if not (all(s > 0 for s in shifts) or all(s < 0 for s in shifts)):
        return None  # ahead here, behind there: no known cause does that
    if equal:  # some ranks only: their equal streams are the evidence, the distances say which way
        who = _ranks([r.rank for r in ranks])
        if shifts and shifts[0] > 0:
            what = f"the resumed run drew more from the streams of {who} only: work that a relaunch does on some ranks only before its first step"
        elif shifts:
            what = (
                f"the uninterrupted run drew more from the streams of {who} only: work that draws from the RNG on some "
                "ranks only between a save and the next step (an evaluation on rank 0) does that, and a relaunch "
                "resumes after it"
            )
        else:
            what = (
                f"something drew from the streams of {who} only, a different number of times in the two runs: work "
                "that draws from the RNG on some ranks only between a save and the next step (an evaluation on rank 0) "
                "does that, and a relaunch resumes after it"
            )
        return Cause.DRAWS_ON_SOME_RANKS, f"{said}; {what}; {_FIX_SOME_RANKS}"
    ahead = shifts[0] > 0
    if not ahead:
        return Cause.RNG_AFTER_RESUME, (
            f"{said}; the uninterrupted run drew more from them, on every rank: either the streams were seeded afresh "
            "instead of restored (ResumeOptions(rng=False): behind by every draw made before the checkpoint), or work "
            "that draws between a save and the next step (an evaluation) was done in the uninterrupted run and "
            f"skipped by the resumed one; resume with the RNG streams (dist_resume's default), and {_FIX_SOME_RANKS}"
        )
    if all(r.shifts.get("torch") == _LOADER_DRAW and set(r.differ) - ignored == {"torch"} for r in ranks):
        return Cause.RNG_AFTER_RESUME, (
            f"{said}; the resumed run made one 64-bit draw more, on every rank: what a DataLoader without generator= "
            "draws each time an iterator is created, and a run resumed mid-epoch creates one more; pass the "
            "DataLoader as dataloader= (its resumed iterators then leave the global stream as it was), or give it "
            "generator=torch.Generator()"
        )
    return Cause.BATCH_HELD, (
        f"{said}; the resumed run drew more from them, on every rank: something the saved streams had drawn already "
        "was drawn again after the resume; a batch drawn from the RNG ahead of the save and held in a variable does "
        f"that (its draws are in the checkpoint, and a resumed run draws another); {_FIX_HELD}"
    )


def data_position_after_resume(ev: Evidence) -> Found | None:
    """The data position is ahead at the first checkpoint written after a resume: named by how far."""
    after = ev.after
    if after is None or not after.differs("data position"):
        return None
    ref, got = (sample_index(p) for p in after.position)
    if ref is None or got is None or got <= ref:
        return None
    ahead, per_step = got - ref, samples_per_step(ev.results)
    rate = f"; {per_step} samples a step in the reference" if per_step else ""
    said = (
        f"the data position at {where(ev, after)} is {ahead} sample{'s' if ahead != 1 else ''} ahead of the "
        f"reference's (sample {got} of the run vs {ref}{rate}): the resumed run skipped samples the uninterrupted run "
        "trained on"
    )
    if per_step and ahead == per_step:
        return Cause.BATCH_HELD, (
            f"{said}, one step's worth: a batch drawn before the save and held in a variable does that (the saved "
            f"position counts it, and a resumed run draws the next one); {_FIX_HELD}"
        )
    return Cause.DATA_POSITION, (
        f"{said}: a DataLoader with workers prefetches batches beyond those trained on, so a sampler's own position "
        "runs ahead of the training; pass the DataLoader as dataloader= with persistent_workers=True, or use "
        "torchdata's StatefulDataLoader, or save dataloader=sampler.state_dict(consumed=<samples trained on>)"
    )
