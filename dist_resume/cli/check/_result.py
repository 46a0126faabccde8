"""What ``dist-resume check`` found: :class:`ResumeCheck` (``dist_resume.testing``), its parts, and its two forms
(``report()`` for people, ``as_dict()`` for ``--json``). Torch-free."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..._core.text import preview, shown
from .._common import SCHEMA_PREFIX
from ._launch import Launch

__all__ = [
    "SCHEMA",
    "Cause",
    "extra_said",
    "PartDifference",
    "StepDifference",
    "HyperparameterDifference",
    "ResumeCheck",
]

SCHEMA: Final = f"{SCHEMA_PREFIX}/check/1"
_SHOWN: Final = 20  # hyperparameter differences in the report (--json lists all)


class Cause(enum.Enum):
    """A known reason for a resume that is not exact (the diagnosis names each one found, with the evidence that
    shows it and its fix)."""

    RELAUNCH_FAILED = "relaunch-failed"
    NOT_DETERMINISTIC = "not-deterministic"
    WORLD_SIZE_CHANGED = "world-size-changed"
    OPTIMIZER_NOT_SAVED = "optimizer-not-saved"
    SCHEDULER_NOT_SAVED = "scheduler-not-saved"
    RNG_AFTER_RESUME = "rng-after-resume"
    BATCH_HELD = "batch-held-ahead"
    DRAWS_ON_SOME_RANKS = "draws-on-some-ranks"
    DATA_POSITION = "data-position"
    DATA_POSITION_NOT_SAVED = "data-position-not-saved"
    RNG_NOT_SAVED = "rng-not-saved"
    RNG_NOT_SEEDED = "rng-not-seeded"
    DDP_FIRST_STEP_BUCKETS = "ddp-first-step-buckets"
    EXTRA_DIFFERS = "extra-differs"


@dataclass(frozen=True)
class PartDifference:
    """How one part differs at a step: ``part`` (model, optimizer, scheduler, scaler, step, epoch, rng, rng (python,
    numpy), data position, extra, ema, world size), its first differing ``key``, that key's ``problem`` in words (the
    largest ``|a-b|`` of a tensor, both values of a number) and how many of the part's entries differ (``count``)."""

    part: str
    key: str
    problem: str
    count: int = 1

    def __str__(self) -> str:
        where = "" if self.key == "-" else f" {self.key}"
        more = f" (and {self.count - 1} more)" if self.count > 1 else ""
        return f"{self.part}{where}: {self.problem}{more}"


@dataclass(frozen=True)
class StepDifference:
    """The first step at which the two runs' checkpoints differ: ``step`` (None for a checkpoint whose name has no
    step, as ``snapshot.pt``), the checkpoint of each run, which launch of the interrupted run wrote it
    (``written_by``: 1 is the first, before any interruption) and every part that differs there."""

    step: int | None
    reference: str
    interrupted: str
    written_by: int | None
    parts: tuple[PartDifference, ...]

    def __str__(self) -> str:
        at = f"step {self.step}" if self.step is not None else self.interrupted
        return f"{at}: {', '.join(p.part for p in self.parts)} differ"


@dataclass(frozen=True)
class HyperparameterDifference:
    """An optimizer hyperparameter (``lr``, ``momentum``, ...) of param group ``group`` that differs at ``step``,
    with the value in the ``reference`` run's checkpoint and in the ``interrupted`` run's."""

    step: int | None
    group: int
    name: str
    reference: Any
    interrupted: Any

    def __str__(self) -> str:
        at = f"step {self.step}" if self.step is not None else "newest"
        return f"{at} group {self.group} {self.name}: {shown(self.reference)} -> {shown(self.interrupted)}"


def extra_said(keys: tuple[str, ...]) -> str:
    """The keys of ``extra`` that differ, in words, with what they are and how to count them."""
    named = preview((f"extra{key}" if key else "extra as a whole" for key in keys), 6, quote=False)
    return (
        f"{named} differ{'s' if len(keys) == 1 else ''}: the script's own entries, while everything the training "
        "holds (model, optimizer, scheduler, scaler, RNG streams, data position, EMA) is equal at every step "
        "compared; a script that writes its bookkeeping after a resume (args.start_epoch, a log of its launches) does "
        "that. --strict-extra (check_resume(..., strict_extra=True)) counts them as a difference"
    )


def _launch_dict(launch: Launch) -> dict[str, Any]:
    return {
        "label": launch.label,
        "seconds": launch.seconds,
        "stopped_at": launch.stopped_at,
        "returncode": launch.returncode,
        "checkpoints": [s.name for s in launch.seen],
    }


@dataclass(frozen=True)
class ResumeCheck:
    """The outcome of :func:`~dist_resume.testing.check_resume` (and ``dist-resume check``).

    ``exact``: the run interrupted ``interrupts`` times (of ``interrupts_asked``) ended bitwise equal to the one that
    never stopped, at every step both folders hold. Otherwise ``first_difference`` says where they part
    (:class:`StepDifference`), ``hyperparameters`` lists every hyperparameter that differs at a common step with both
    values, and ``diagnosis`` names the known causes found, each with the part and step that show it and its fix (when
    no known cause fits, it says so and where the first difference is; None only when exact; ``causes``: the causes
    named, as :class:`Cause` members). ``steps`` lists the steps compared (``(step, equal)``, ascending; the newest
    last), ``reference`` and ``launches`` the runs (wall times, when each was stopped), ``folders`` the two checkpoint
    folders when they were kept, ``notes`` what the check saw that does not change the verdict (Python's and NumPy's
    streams left unseeded, saved strings that named the run's folder). ``extra_differs``: where the trained state is
    exact but ``extra`` (the script's own bookkeeping, such as ``args.start_epoch`` written after a resume) differs,
    its keys that differ (``['args']['start_epoch']``; ``strict_extra`` counts them as a difference instead).
    ``report()`` is what the command prints.
    """

    command: tuple[str, ...]
    exact: bool
    interrupts: int
    interrupts_asked: int
    signal: str
    device: str | None
    steps: tuple[tuple[int | None, bool], ...]
    first_difference: StepDifference | None
    hyperparameters: tuple[HyperparameterDifference, ...]
    causes: tuple[Cause, ...]
    diagnosis: str | None
    reference: Launch
    launches: tuple[Launch, ...]
    wall_seconds: float
    compare_seconds: float
    folders: tuple[Path, Path] | None = None
    notes: tuple[str, ...] = ()
    extra_differs: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object (schema ``dist-resume/check/1``)."""
        first = self.first_difference
        return {
            "schema": SCHEMA,
            "command": list(self.command),
            "exact": self.exact,
            "interrupts": {
                "asked": self.interrupts_asked,
                "done": self.interrupts,
                "signal": self.signal,
                "at": [launch.stopped_at for launch in self.launches if launch.stopped_at is not None],
            },
            "device": self.device,
            "steps": [{"step": step, "equal": equal} for step, equal in self.steps],
            "first_difference": None
            if first is None
            else {
                "step": first.step,
                "reference": first.reference,
                "interrupted": first.interrupted,
                "written_by_launch": first.written_by,
                "parts": [vars(p) for p in first.parts],
            },
            "hyperparameters": [vars(h) for h in self.hyperparameters],
            "causes": [c.value for c in self.causes],
            "diagnosis": self.diagnosis,
            "notes": list(self.notes),
            "extra_differs": list(self.extra_differs),
            "wall_seconds": {
                "reference": self.reference.seconds,
                "interrupted": round(sum(launch.seconds for launch in self.launches), 3),
                "compare": self.compare_seconds,
                "total": self.wall_seconds,
            },
            "reference": _launch_dict(self.reference),
            "launches": [_launch_dict(launch) for launch in self.launches],
            "folders": None
            if self.folders is None
            else {"reference": str(self.folders[0]), "interrupted": str(self.folders[1])},
        }

    def report(self) -> str:
        """The human-readable report ``dist-resume check`` prints."""
        head = (
            f"exact: interrupted {self.interrupts} time(s), the run ended bitwise equal to the uninterrupted one"
            if self.exact
            else "different: the interrupted run does not end as the uninterrupted one"
        )
        if self.exact and self.extra_differs:
            head = (
                f"exact: interrupted {self.interrupts} time(s), the trained state ended bitwise equal to the "
                "uninterrupted run's; only extra differs"
            )
        lines = [head, f"  command      {' '.join(self.command)}"]
        if self.exact and self.extra_differs:
            lines.append(f"  extra        {extra_said(self.extra_differs)}")
        stops = [
            f"launch {i} at {launch.stopped_at:.1f} s"
            for i, launch in enumerate(self.launches, 1)
            if launch.stopped_at is not None
        ]
        asked = f" of {self.interrupts_asked}" if self.interrupts != self.interrupts_asked else ""
        how = "SIGKILL to the whole process tree" if self.signal == "KILL" else "SIGTERM to the launch's process group"
        lines.append(
            f"  interrupted  {self.interrupts}{asked} time(s) ({how}): {', '.join(stops) or '-'}"
            + (f"; on the test accelerator ({self.device})" if self.device else "")
        )
        if self.steps:
            said = preview(
                (f"{s if s is not None else 'newest'} {'=' if eq else '!='}" for s, eq in self.steps), 8, quote=False
            )
            lines.append(f"  compared     {len(self.steps)} checkpoint(s) of both runs, by step: {said}")
        first = self.first_difference
        if first is not None:
            at = f"step {first.step}" if first.step is not None else "the newest checkpoint"
            by = f", written by launch {first.written_by}" if first.written_by is not None else ""
            lines.append(f"  first difference at {at} ({first.interrupted}{by}); A: reference, B: interrupted")
            lines += [f"    {p}" for p in first.parts]
        if self.hyperparameters:
            lines.append("  hyperparameters that differ (reference -> interrupted):")
            lines += [f"    {h}" for h in self.hyperparameters[:_SHOWN]]
            if len(self.hyperparameters) > _SHOWN:
                lines.append(f"    ... and {len(self.hyperparameters) - _SHOWN} more (--json lists all)")
        if not self.exact:
            causes = (self.diagnosis or "no known cause fits; the differences above say where").splitlines()
            lines += [f"  {'diagnosis' if i == 0 else '':<12} {text}" for i, text in enumerate(causes)]
        lines += [f"  note         {note}" for note in self.notes]
        interrupted = sum(launch.seconds for launch in self.launches)
        lines.append(
            f"  wall time    {self.wall_seconds:.1f} s: reference {self.reference.seconds:.1f} s, interrupted run "
            f"{interrupted:.1f} s in {len(self.launches)} launches, comparison {self.compare_seconds:.1f} s"
        )
        if self.folders is not None:
            lines.append(f"  kept         reference {self.folders[0]}, interrupted {self.folders[1]}")
        return "\n".join(lines)
