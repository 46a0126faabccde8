"""Testing resume logic, in your CI or ours: does a training command resume exactly, and multi-process runs.

:func:`check_resume` is ``dist-resume check`` as one call, so that a CI job is one test: it runs a training command
once uninterrupted, then once more stopped ``interrupts`` times (SIGKILL to the whole process tree, as a preemption)
and relaunched, and compares the checkpoints both runs left, part by part, as ``resume`` reads them. It returns a
:class:`ResumeCheck`: ``exact``, or the first step at which they differ, what differs there, and a diagnosis where
the cause is known (a scheduler that is not saved, a ``DataLoader`` without ``generator=``, the optimizer state
missing from the checkpoint, ...). ``device="sim"`` runs the command on the test accelerator, simulated devices on
the CPU (:mod:`dist_resume.testing.sim`).

:func:`run_ranks` starts ``world_size`` processes on this machine, gives each torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``) and an initialised
process group (gloo by default, joined through a ``FileStore``: no port is picked), calls
``fn(rank, world_size, *args)`` in each and returns the results in rank order. When a rank raises,
dies or hangs, :class:`RankFailure` names every such rank with its traceback; the survivors and
everything they started are killed. dist_resume's own tests and benchmarks use it.

:func:`kill_tree` stops a launch as a preemption does: SIGKILL to a process, everything below it and each one's
process group (torchrun's workers run in sessions of their own: killing torchrun's group leaves them training).

Timeouts nest so that a hang is reported, never waited out: the process group's timeout is shorter
than ``timeout`` (the deadline for the whole launch), which should be shorter than your test
runner's own timeout.

Example (CPU only; ``fn`` must be a module-level function of an importable module, so the new
processes can import it)::

    # test_my_resume.py
    import torch
    import torch.distributed as dist
    from dist_resume.testing import check_resume, run_ranks

    def test_train_py_resumes_exactly():
        check = check_resume(["python", "train.py", "--ckpt-dir", "{dir}"], timeout=300)
        assert check.exact, check.report()

    def add_ranks(rank: int, world_size: int) -> float:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)  # collective across the real processes
        return t.item()

    def test_all_reduce():
        assert run_ranks(add_ranks, 2, timeout=60) == [3.0, 3.0]
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .._core.procs import kill_process_group, kill_tree
from .._core.publish import publish
from ..cli.check import (
    Cause,
    CheckOptions,
    HyperparameterDifference,
    Launch,
    PartDifference,
    ResumeCheck,
    Seen,
    StepDifference,
    StopSignal,
    run_check,
)
from ._ranks import RankFailure, run_ranks

__all__ = [
    "RankFailure",
    "run_ranks",
    "kill_process_group",
    "kill_tree",
    "check_resume",
    "ResumeCheck",
    "StepDifference",
    "PartDifference",
    "HyperparameterDifference",
    "Cause",
    "Launch",
    "Seen",
]


def check_resume(
    command: str | Sequence[str],
    *,
    interrupts: int = 2,
    seed: int = 0,
    timeout: float | None = None,
    signal: str = "KILL",
    device: str | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    keep: bool = False,
    strict_extra: bool = False,
) -> ResumeCheck:
    """Does ``command`` resume exactly? ``dist-resume check`` as a call; returns a :class:`ResumeCheck`.

    Local: call it from one ordinary process (a test); it starts the command's processes, and kills every one of
    them it stops, torchrun's workers included. ``command`` (a list, or a string split as a shell would) holds
    ``{dir}`` where it takes its checkpoint folder: the check gives each run a fresh one in a temporary folder. The
    command runs once uninterrupted, then once more stopped ``interrupts`` times (at moments drawn with ``seed``;
    ``signal`` ``"KILL"``: SIGKILL to the whole process tree, ``"TERM"``: SIGTERM to its process group, SIGKILL 30 s
    later) and relaunched unchanged; ``timeout`` seconds at most per run. Then the newest checkpoint of each folder,
    and every step both still hold, are compared part by part as ``resume`` reads them. ``device="sim"`` runs every
    Python process of the command on the test accelerator (:mod:`dist_resume.testing.sim`); ``env`` is added to
    this process's environment for the command, ``cwd`` is where it runs, ``keep`` keeps both folders
    (``ResumeCheck.folders``) and the logs. Where only ``extra`` differs (the script's own entries, such as
    ``args.start_epoch`` written after a resume) the resume is exact and ``ResumeCheck.extra_differs`` names the keys;
    ``strict_extra=True`` counts them as a difference.

    Raises :class:`~dist_resume.errors.UsageError` for a command without ``{dir}``, and
    :class:`~dist_resume.errors.CheckCommandError` (with the command's last lines of stderr) when it fails by itself,
    writes no checkpoint, or outlives ``timeout``.

    Example (a test; each run of the command is a fresh process, here ~3 s)::

        >>> check = check_resume(["python", "train.py", "{dir}"], timeout=120)  # doctest: +SKIP
        >>> check.exact, check.interrupts  # doctest: +SKIP
        (True, 2)
        >>> print(check.report())  # doctest: +SKIP
        exact: interrupted 2 time(s), the run ended bitwise equal to the uninterrupted one
        ...
    """
    options = CheckOptions(
        interrupts=interrupts,
        seed=seed,
        timeout=timeout,
        signal=StopSignal.parse(signal),
        device=device,
        env=env,
        cwd=None if cwd is None else Path(cwd),
        keep=keep,
        strict_extra=strict_extra,
    )
    return run_check(command, options)


def __getattr__(name: str) -> object:
    """``dist_resume.testing.sim`` without importing it first (it imports torch: loaded on first use)."""
    if name == "sim":
        return importlib.import_module("dist_resume.testing.sim")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


publish(globals(), __all__, __name__)

del publish
