"""Why a resume is not exact, where the two runs' checkpoints show a known cause: each :class:`Cause` found, in words
with its fix. Torch-free.

The primary causes are read from what differs and what the checkpoints hold; two weaker ones (no data position, no
RNG streams in the checkpoints) are named only when no primary cause explains the difference.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .._core.text import preview, shown
from ._check_compare import UNSEEDED_PART, PairResult, unseeded_said
from ._check_result import Cause
from ._check_run import Launch, stderr_tail

__all__ = ["Evidence", "diagnose"]

_TRUNCATED = ("central directory", "zip archive", "EOFError", "Ran out of input", "truncated", "unexpected end")


@dataclass(frozen=True)
class Evidence:
    """What the diagnosis reads: the compared pairs (ascending, the newest last), the first that differs, the
    interrupted run's launches and which launch wrote each of its checkpoints (by name; 1 is the first launch).
    ``unseeded``: Python's and NumPy's streams differ at every pair (a command that does not seed them); ``first`` is
    then the first pair where something else differs too."""

    results: Sequence[PairResult]
    first: PairResult | None
    launches: Sequence[Launch]
    written_by: dict[str, int]
    unseeded: bool = False


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
    return (
        f"the runs differ already at {first.pair.interrupted.name}, which the interrupted run wrote before its first "
        "interruption: the command is not deterministic by itself, so no resume can be exact (seed every RNG; on "
        "GPUs torch.use_deterministic_algorithms(True); no data order from the clock or a directory listing)"
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
        f"the world size changed ({a} -> {b}): at another world size a resume is not bitwise equal (each rank's RNG "
        "streams and share of the data change); run the check with a fixed number of processes"
    )


def _optimizer(ev: Evidence) -> str | None:
    if not any(r.held["optimizer"] == (False, False) for r in ev.results):
        return None
    return (
        "the checkpoints hold no optimizer state (as PyTorch's DDP tutorial's snapshot: the model and the epoch): a "
        "resumed run starts the optimizer afresh (momentum buffers, Adam's moments, its step counts); save "
        "optimizer.state_dict() and load it, or register the optimizer (CheckpointManager(..., optimizer=opt))"
    )


def _scheduler(ev: Evidence) -> str | None:
    if any(r.held["scheduler"] != (False, False) for r in ev.results):
        return None
    if not any(h.name == "lr" for r in ev.results for h in r.hyperparameters):
        return None  # lr is the same in both runs at every step compared: whatever moves it, it is not the cause
    series = [r.lr[0] for r in ev.results if r.lr[0] is not None]
    moves = len({shown(v) for v in series}) > 1
    seen = f" ({preview((shown(v) for v in series), 4, quote=False)} at the steps compared)" if moves else ""
    return (
        f"the checkpoints hold no LR scheduler, but lr moves{seen} and differs after a resume: the scheduler is not "
        "saved (not registered), so a resumed run restarts its schedule; register it (CheckpointManager(..., scheduler=sched)) or save and load "
        "sched.state_dict()"
    )


def _rng(ev: Evidence) -> str | None:
    first = ev.first
    if first is None or ev.written_by.get(first.pair.interrupted.name, 1) == 1:
        return None
    if not (first.differs("rng") or (not ev.unseeded and first.differs(UNSEEDED_PART))):
        return None
    return (
        f"the RNG streams differ at {first.pair.interrupted.name}, written after a resume: the RNG streams are not "
        "restored (ResumeOptions(rng=False), or a checkpoint saved without them), or a DataLoader without generator= "
        "was not given to the checkpoint (each new iterator draws from the global RNG, and a resumed run creates one "
        "more); resume with the RNG streams (dist_resume's default) and pass the DataLoader as dataloader= (its "
        "resumed iterators then leave the global stream as it was), or give it generator=torch.Generator()"
    )


def _data_position(ev: Evidence) -> str | None:
    if ev.first is None or not ev.first.differs("data position"):
        return None
    return (
        f"the data position differs at {ev.first.pair.interrupted.name}: a DataLoader with workers prefetches "
        "batches beyond those trained on, so a sampler's own position runs ahead of the training; pass the "
        "DataLoader as dataloader= with persistent_workers=True, or use torchdata's StatefulDataLoader, or save "
        "dataloader=sampler.state_dict(consumed=<samples trained on>)"
    )


def _not_saved(part: str, text: str) -> Callable[[Evidence], str | None]:
    """The rule "neither checkpoint holds ``part``", said as ``text``."""

    def rule(ev: Evidence) -> str | None:
        return text if ev.first is not None and ev.first.held[part] == (False, False) else None

    return rule


_no_data_position = _not_saved(
    "sampler",
    "the checkpoints hold no data position: a resumed run starts its epoch over, or draws another order; register "
    "the DataLoader (CheckpointManager(..., dataloader=loader), its sampler a ResumableDistributedSampler) so that "
    "the position is saved and restored",
)
_no_rng = _not_saved(
    "rng",
    "the checkpoints hold no RNG streams: after a resume, random draws (dropout, augmentation, shuffling) differ from "
    "the uninterrupted run's; save and restore every rank's streams (dist_resume's default)",
)


_PRIMARY = (
    (Cause.RELAUNCH_FAILED, _relaunch_failed),
    (Cause.NOT_DETERMINISTIC, _not_deterministic),
    (Cause.RNG_NOT_SEEDED, _not_seeded),
    (Cause.WORLD_SIZE_CHANGED, _world_size),
    (Cause.OPTIMIZER_NOT_SAVED, _optimizer),
    (Cause.SCHEDULER_NOT_SAVED, _scheduler),
    (Cause.RNG_AFTER_RESUME, _rng),
    (Cause.DATA_POSITION, _data_position),
)
_FALLBACK = ((Cause.DATA_POSITION_NOT_SAVED, _no_data_position), (Cause.RNG_NOT_SAVED, _no_rng))


def diagnose(ev: Evidence) -> tuple[tuple[Cause, ...], str | None]:
    """The known causes ``ev`` shows, and the diagnosis: each one's sentence, a line each (None when none is known)."""
    found = [(cause, text) for cause, rule in _PRIMARY if (text := rule(ev))]
    if not found:
        found = [(cause, text) for cause, rule in _FALLBACK if (text := rule(ev))]
    return tuple(c for c, _ in found), ("\n".join(t for _, t in found) or None)
