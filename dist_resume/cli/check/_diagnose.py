"""Why a resume is not exact, where the two runs' checkpoints show a known cause: each :class:`Cause` found, in words
with its evidence (the part and the step that show it) and its fix; where none fits, a sentence that says so and
points to the first difference.

The primary causes are read from what differs and what the checkpoints hold (those read at the first checkpoint
written after a resume: :mod:`._diagnose_resume`, and from what the checkpoints record about the run's set-up:
:mod:`._diagnose_setup`); two weaker ones (no data position, no RNG streams in the checkpoints) are named only when
no primary cause explains a model that differs after a resume. With ``--strict-extra``, ``extra`` alone differing
is a cause of its own, named alone.
"""

from __future__ import annotations

from collections.abc import Callable

from ..._core.text import preview, shown
from ._compare import EXTRA_PART, UNSEEDED_PART, PairResult, unseeded_said
from ._diagnose_resume import data_position_after_resume, rng_after_resume
from ._diagnose_setup import ddp_first_step, prefetched_position
from ._evidence import Evidence, where
from ._launch import stderr_tail
from ._result import Cause, extra_said

__all__ = ["diagnose"]

_TRUNCATED = ("central directory", "zip archive", "EOFError", "Ran out of input", "truncated", "unexpected end")
Rule = Callable[[Evidence], "tuple[Cause, str] | None"]


def _relaunch_failed(ev: Evidence) -> str | None:
    failed = next(((i, launch) for i, launch in enumerate(ev.launches, 1) if i > 1 and launch.failed), None)
    if failed is None:
        return None
    number, launch = failed
    tail = stderr_tail(launch.stderr, 3).replace("\n", " | ")
    truncated = any(marker in tail for marker in _TRUNCATED)
    why = (
        "it could not read the checkpoint the interruption left: torch.save is not atomic, a checkpoint being "
        "written when the run was stopped is incomplete; write to a temporary file and os.replace it (as "
        "dist_resume's CheckpointManager does)"
        if truncated
        else "resuming from what the interruption left fails"
    )
    return f"launch {number} (a relaunch after an interruption) failed with exit status {launch.returncode}: {why} ({tail})"


def _not_deterministic(ev: Evidence) -> str | None:
    first = ev.first
    if first is None or ev.written_by.get(first.pair.interrupted.name) != 1 or len(ev.launches) < 2:
        return None
    parts = preview((p.part for p in first.parts), 4, quote=False)
    return (
        f"the runs differ already at {where(ev, first)} ({parts}): the command is not deterministic by itself, so no "
        "resume can be exact (seed every RNG; on GPUs torch.use_deterministic_algorithms(True); no data order from "
        "the clock or a directory listing)"
    )


def _not_seeded(ev: Evidence) -> str | None:
    if ev.first is None:
        return None
    before = next(
        (r for r in ev.results if r.differs(UNSEEDED_PART) and ev.written_by.get(r.pair.interrupted.name) == 1), None
    )
    if before is None:
        return None
    names, one, how = unseeded_said(before.streams)
    it = "it" if one else "them"
    return (
        f"{names} differ{'s' if one else ''} already at {before.pair.interrupted.name}, written before the first "
        f"interruption: the command does not seed {it}, so each process starts {it} from the OS's entropy, and what "
        f"draws from {it} (augmentation, shuffling) differs in every run; seed {it}: dist_resume.seed_rng(seed), or "
        f"{how}"
    )


def _world_size(ev: Evidence) -> str | None:
    changed = next((r for r in ev.results if r.differs("world size")), None)
    if changed is None:
        return None
    a, b = changed.world_size
    return (
        f"the world size changed ({a} -> {b}, at {where(ev, changed)}): at another world size a resume is not bitwise "
        "equal (each rank's RNG streams and share of the data change); run the check with a fixed number of processes"
    )


def _model_after(ev: Evidence) -> PairResult | None:
    """The first checkpoint written after a resume, where its model differs (the training went another way)."""
    after = ev.after
    return after if after is not None and after.differs("model") else None


def _model_said(ev: Evidence, result: PairResult) -> str:
    model = next(p for p in result.parts if p.part == "model")
    return f"the model differs at {where(ev, result)} ({model})"


def _optimizer(ev: Evidence) -> str | None:
    after = _model_after(ev)
    if after is None or after.held["optimizer"] != (False, False):
        return None
    return (
        "the checkpoints hold no optimizer state (as PyTorch's DDP tutorial's snapshot: the model and the epoch), and "
        f"{_model_said(ev, after)}: a resumed run starts the optimizer afresh (momentum buffers, Adam's moments, its "
        "step counts); save optimizer.state_dict() and load it, or register the optimizer (CheckpointManager(..., "
        "optimizer=opt))"
    )


def _scheduler(ev: Evidence) -> str | None:
    if any(r.held["scheduler"] != (False, False) for r in ev.results):
        return None
    lr = next(((r, h) for r in ev.results for h in r.hyperparameters if h.name == "lr"), None)
    if lr is None:
        return None  # lr is the same in both runs at every step compared: whatever moves it, it is not the cause
    at, h = lr
    series = [r.lr[0] for r in ev.results if r.lr[0] is not None]
    moves = len({shown(v) for v in series}) > 1
    seen = f" ({preview((shown(v) for v in series), 4, quote=False)} at the steps compared)" if moves else ""
    return (
        f"the checkpoints hold no LR scheduler, but lr moves{seen} and differs at {where(ev, at)} (group {h.group}: "
        f"{shown(h.reference)} -> {shown(h.interrupted)}): the scheduler is not saved (not registered), so a resumed "
        "run restarts its schedule; register it (CheckpointManager(..., scheduler=sched)) or save and load "
        "sched.state_dict()"
    )


def _not_saved(part: str, text: str) -> Callable[[Evidence], str | None]:
    """The rule "neither checkpoint holds ``part``, and the model differs after a resume", said as ``text``."""

    def rule(ev: Evidence) -> str | None:
        after = _model_after(ev)
        if after is None or after.held[part] != (False, False):
            return None
        return text.format(model=_model_said(ev, after))

    return rule


_no_data_position = _not_saved(
    "sampler",
    "the checkpoints hold no data position, and {model}: a resumed run starts its epoch over, or draws another order; "
    "register the DataLoader (CheckpointManager(..., dataloader=loader), its sampler a ResumableDistributedSampler) "
    "so that the position is saved and restored",
)
_no_rng = _not_saved(
    "rng",
    "the checkpoints hold no RNG streams, and {model}: after a resume, random draws (dropout, augmentation, "
    "shuffling) differ from the uninterrupted run's; save and restore every rank's streams (dist_resume's default)",
)


def _named(cause: Cause, rule: Callable[[Evidence], str | None]) -> Rule:
    def found(ev: Evidence) -> tuple[Cause, str] | None:
        text = rule(ev)
        return (cause, text) if text else None

    return found


def _extra_only(ev: Evidence) -> str | None:
    """``--strict-extra``: ``extra`` is the only part that differs, at any step compared."""
    parts = {p.part for r in ev.results for p in r.parts} - ({UNSEEDED_PART} if ev.unseeded else set())
    if not ev.strict_extra or parts != {EXTRA_PART}:
        return None
    keys = tuple(dict.fromkeys(key for r in ev.results for key in r.extra_keys))
    at = where(ev, ev.first) if ev.first is not None else "the steps compared"
    return f"only extra differs (from {at} on): {extra_said(keys)}"


def _after_resume(ev: Evidence) -> list[tuple[Cause, str]]:
    """The causes read at the first checkpoint written after a resume; a data position recorded to count prefetched
    batches, where it differs, alone: the streams and the model that differ follow from it."""
    prefetched = prefetched_position(ev)
    if prefetched is not None:
        return [prefetched]
    return [hit for rule in (rng_after_resume, data_position_after_resume, ddp_first_step) if (hit := rule(ev))]


_PRIMARY: tuple[Rule, ...] = (
    _named(Cause.RELAUNCH_FAILED, _relaunch_failed),
    _named(Cause.NOT_DETERMINISTIC, _not_deterministic),
    _named(Cause.RNG_NOT_SEEDED, _not_seeded),
    _named(Cause.WORLD_SIZE_CHANGED, _world_size),
    _named(Cause.OPTIMIZER_NOT_SAVED, _optimizer),
    _named(Cause.SCHEDULER_NOT_SAVED, _scheduler),
)
_FALLBACK: tuple[Rule, ...] = (
    _named(Cause.DATA_POSITION_NOT_SAVED, _no_data_position),
    _named(Cause.RNG_NOT_SAVED, _no_rng),
)


def _none_fits(ev: Evidence) -> str | None:
    first = ev.first
    if first is None or not first.parts:
        return None
    return (
        f"no known cause fits: the first difference is at {where(ev, first)}, {first.parts[0]}; compare what the "
        "command saves and restores with what it changes between a save and the next step"
    )


def diagnose(ev: Evidence) -> tuple[tuple[Cause, ...], str | None]:
    """The known causes ``ev`` shows, and the diagnosis: each one's sentence with its evidence, a line each; where no
    known cause fits, a sentence that says so and points to the first difference (None when nothing differs)."""
    extra = _extra_only(ev)
    if extra is not None:  # nothing else differs anywhere: no other cause has anything to show
        return (Cause.EXTRA_DIFFERS,), extra
    found = [hit for rule in _PRIMARY if (hit := rule(ev))] + _after_resume(ev)
    if not found:
        found = [hit for rule in _FALLBACK if (hit := rule(ev))]
    causes = tuple(dict.fromkeys(c for c, _ in found))
    return causes, ("\n".join(t for _, t in found) or _none_fits(ev))
