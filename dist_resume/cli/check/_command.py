"""``dist-resume check``: does a training command resume exactly? The check behind ``dist_resume.testing.check_resume``.

COMMAND runs once uninterrupted in a fresh folder (``{dir}``: the reference), then once more in another fresh folder,
stopped ``interrupts`` times and relaunched unchanged after each stop. Each stop comes at a moment drawn (``seed``)
over the reference's timeline, between the checkpoint after the one the launch resumes from and the reference's last
(:func:`_stop_rule`), so never before the folder holds a checkpoint newer than at that launch's start. Then the newest checkpoint of each folder, and every earlier step both still hold, are read as ``resume`` reads
them and compared part by part (:mod:`._compare`), a saved string that names a run's folder compared as
``<run folder>`` (:mod:`._mask`); a known cause of what differs is named only with its evidence
(:mod:`._diagnose`). A command that fails by itself, writes no checkpoint, or outlives ``timeout`` is an error
(:class:`~dist_resume.errors.CheckCommandError`), never a verdict; so is one that writes a single checkpoint, or
whose relaunches write none (nothing would be checked).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..._core.errors import CheckCommandError, UsageError
from .._common import ExitCode, print_json
from ._launch import Launch, StopRule, StopSignal, launch, stderr_tail
from ._result import ResumeCheck
from ._watch import FolderWatch

__all__ = ["PLACEHOLDER", "DEVICES", "CheckOptions", "command_argv", "run_check", "main_check"]

PLACEHOLDER: Final = "{dir}"
DEVICES: Final = ("sim",)  # what --device may name: the test accelerator (dist_resume.testing.sim)


@dataclass(frozen=True)
class CheckOptions:
    """How :func:`run_check` runs: ``interrupts`` stops (at least 1) at moments drawn with ``seed``, each a
    ``signal`` (:class:`StopSignal`); ``timeout`` seconds at most per launch (None: no limit); ``device`` "sim" runs
    every Python process of the command on the test accelerator; ``env`` is added to this process's environment;
    ``cwd`` is where the command runs (default: here); ``keep`` keeps both folders and the logs; ``strict_extra``
    counts a difference in ``extra`` (the script's own entries) as a difference."""

    interrupts: int = 2
    seed: int = 0
    timeout: float | None = None
    signal: StopSignal = StopSignal.KILL
    device: str | None = None
    env: Mapping[str, str] | None = None
    cwd: Path | None = None
    keep: bool = False
    strict_extra: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.interrupts, bool) or not isinstance(self.interrupts, int) or self.interrupts < 1:
            raise UsageError(
                f"interrupts={self.interrupts!r}: the check needs at least 1 interruption (2 by default)",
                hint="e.g. --interrupts 2",
            )
        if self.timeout is not None and not self.timeout > 0:
            raise UsageError(
                f"timeout={self.timeout!r} is not a positive number of seconds (leave it unset for no limit)",
                hint="e.g. --timeout 600",
            )
        if self.device is not None and self.device not in DEVICES:
            raise UsageError(
                f"device={self.device!r} is not one the check provides: use 'sim' (the test accelerator), or leave it "
                "unset for what torch reports",
                hint="--device sim, or no --device",
            )


def command_argv(command: str | Sequence[str]) -> list[str]:
    """COMMAND as arguments (a string is split as a shell would), checked to hold ``{dir}``."""
    argv = shlex.split(command) if isinstance(command, str) else [str(a) for a in command]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise UsageError("no COMMAND to check", hint="dist-resume check [options] -- python train.py --ckpt {dir}")
    if not any(PLACEHOLDER in a for a in argv):
        raise UsageError(
            f"COMMAND has no {PLACEHOLDER}: {shlex.join(argv)!r}; the check gives each run a fresh checkpoint folder "
            f"and must know where the command saves",
            hint=f"put {PLACEHOLDER} where the command takes its checkpoint folder, e.g. --ckpt-dir {PLACEHOLDER}",
        )
    return argv


def _environment(options: CheckOptions) -> dict[str, str]:
    env = {**os.environ, **(options.env or {})}
    if options.device == "sim":
        from ..._sim.activate import DEVICES_ENV
        from ..._sim.boot import startup_dir, worker_env
        from ..._sim.build import built_library, unavailable_reason

        reason = unavailable_reason()
        if reason is not None:
            raise UsageError(f"--device sim: {reason}", hint="run the check without --device on this machine")
        if built_library() is None:
            from ..._core.log import logger  # torch's (via the rank look-up): imported where it logs

            logger.warning("building the test accelerator (first use here: about 15 s on 2 cores)")
        count = env.get(DEVICES_ENV, "").strip()
        env.update(worker_env(int(count) if count.isdigit() and int(count) > 0 else 2))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(startup_dir()), env.get("PYTHONPATH")]))
    return env


def _stop_rule(ref: Launch, resumed_from: int, rng: random.Random) -> StopRule:
    """When a launch is stopped, drawn over the reference's timeline: a moment between the checkpoint after the one
    the launch resumes from (``resumed_from``, an index in the reference's checkpoints; -1 for the first launch) and
    the reference's last but one, said as "so long after the launch's k-th new checkpoint" (the reference's start-up
    and pace do not carry over to a relaunch, its order of checkpoints does). Ending the window one checkpoint before
    the last keeps a launch that runs faster than the reference short of its end."""
    times = [s.seconds for s in ref.seen]
    first = min(resumed_from + 1, len(times) - 1)
    end = max(first, len(times) - 2)
    moment = times[first] + rng.random() * (times[end] - times[first])
    k = max(i for i in range(first, end + 1) if times[i] <= moment)
    if k <= resumed_from:  # resumed from the reference's last checkpoint: stopped at its first new one
        return StopRule(checkpoints=1, delay=0.0)
    return StopRule(checkpoints=k - resumed_from, delay=round(moment - times[k], 3))


def _progress(ref: Launch, watch: FolderWatch, launches: Sequence[Launch]) -> int:
    """Which of the reference's checkpoints the interrupted run resumes from (an index): by step where the names
    carry one, else by how many checkpoints its launches wrote."""
    complete = [e for e in watch.look(time.monotonic()) if e.complete]
    steps = [i for i, s in enumerate(ref.seen) if complete and s.step is not None and s.step == complete[-1].step]
    if steps:
        return steps[-1]
    written = sum(len(launch.seen) for launch in launches)
    return min(max(written - 1, 0), len(ref.seen) - 1)


def _no_checkpoint(ref: Launch, folder: Path) -> CheckCommandError:
    held = sorted(os.listdir(folder))
    found = f"it holds {', '.join(held[:8])}{' ...' if len(held) > 8 else ''}" if held else "it is empty"
    return _of_reference(
        ref,
        f"the reference run ended after {ref.seconds:.1f} s and no checkpoint appeared in {PLACEHOLDER} ({found}): "
        "nothing could be interrupted. {dir} must be the folder the command saves its checkpoints in, and the command "
        "must save before it ends",
    )


def _one_checkpoint(ref: Launch) -> CheckCommandError:
    only = ref.seen[0]
    return _of_reference(
        ref,
        f"the reference run wrote only one checkpoint ({only.name}, at {only.seconds:.1f} s of its {ref.seconds:.1f} "
        "s): the check needs one to stop after and a later one, written after the resume, to compare. Save during the "
        "run more often (every N steps, or each epoch), so that it writes at least two",
    )


def _of_reference(ref: Launch, message: str) -> CheckCommandError:
    return CheckCommandError(message, run="reference", returncode=ref.returncode, stderr=stderr_tail(ref.stderr))


def _failed(run: Launch, what: str) -> CheckCommandError:
    return CheckCommandError(
        f"COMMAND failed on its own: {what} exited with status {run.returncode} after {run.seconds:.1f} s, before any "
        "interruption",
        run=run.label,
        returncode=run.returncode,
        stderr=stderr_tail(run.stderr),
    )


def _import_compare() -> None:
    from ._compare import compare_pair  # noqa: F401  (torch and the readers, while the command runs)


def _interrupted_run(
    argv: list[str], ref: Launch, work: Path, options: CheckOptions, env: dict[str, str]
) -> tuple[Path, list[Launch]]:
    """The launches of the interrupted run, and its folder; a first launch that ends before it could be stopped is
    tried once more in a fresh folder, stopped at its first checkpoint."""
    rng = random.Random(options.seed)
    for attempt in (1, 2):
        folder = work / ("interrupted" if attempt == 1 else "interrupted-again")
        folder.mkdir()
        watch, launches = FolderWatch(folder), list[Launch]()
        run_argv = [a.replace(PLACEHOLDER, str(folder)) for a in argv]
        for i in range(options.interrupts + 1):
            last = i == options.interrupts
            if last:
                threading.Thread(target=_import_compare, daemon=True).start()
            rule = _stop_rule(ref, _progress(ref, watch, launches) if launches else -1, rng)
            if attempt == 2 and not launches:
                rule = StopRule(checkpoints=1, delay=0.0)
            logs = work / f"{folder.name}-launch-{i + 1}"
            run = launch(
                run_argv,
                label=f"launch {i + 1}",
                watch=watch,
                env=env,
                cwd=options.cwd,
                logs=logs,
                timeout=options.timeout,
                stop=None if last else rule,
                sig=options.signal,
            )
            launches.append(run)
            if run.stopped_at is None:
                break
        first = launches[0]
        if first.failed:
            raise _failed(first, "the interrupted run's first launch (the reference had succeeded)")
        if first.stopped_at is not None:
            return folder, launches
        from ..._core.log import logger

        logger.info("launch 1 ended by itself before its stop; once more, stopped at its first new checkpoint")
    raise CheckCommandError(
        "nothing could be interrupted: twice the interrupted run's first launch ended before a checkpoint was "
        f"complete in {PLACEHOLDER} while it ran (the reference's first appeared {ref.seen[0].seconds:.1f} s after its "
        f"start, its end came at {ref.seconds:.1f} s); the command must save during the run, not only at its end",
        run="launch 1",
        returncode=0,
    )


def run_check(command: str | Sequence[str], options: CheckOptions) -> ResumeCheck:
    """Run the check of ``command`` (holding ``{dir}``) as ``options`` say. Local: it starts the command's processes.

    Raises :class:`~dist_resume.errors.UsageError` for a command without ``{dir}`` and
    :class:`~dist_resume.errors.CheckCommandError` when the command cannot be started, fails by itself, writes fewer
    than two checkpoints or none after a resume, or outlives the timeout.
    """
    argv = command_argv(command)
    env = _environment(options)
    start = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="dist-resume-check."))
    try:
        ref_dir = work / "reference"
        ref_dir.mkdir()
        ref_argv = [a.replace(PLACEHOLDER, str(ref_dir)) for a in argv]
        ref = launch(
            ref_argv,
            label="reference",
            watch=FolderWatch(ref_dir),
            env=env,
            cwd=options.cwd,
            logs=work / "reference",
            timeout=options.timeout,
        )
        if ref.failed:
            raise _failed(ref, "the reference run")
        if not ref.seen:
            raise _no_checkpoint(ref, ref_dir)
        if len(ref.seen) < 2:  # a version each: a snapshot rewritten in place counts once per save
            raise _one_checkpoint(ref)
        got_dir, launches = _interrupted_run(argv, ref, work, options, env)
        from ._verdict import verdict

        folders = (ref_dir, got_dir)
        check = verdict(
            argv,
            ref,
            launches,
            folders,
            asked=options.interrupts,
            signal=options.signal.value,
            strict_extra=options.strict_extra,
        )
        return dataclasses.replace(
            check,
            device=options.device,
            wall_seconds=round(time.monotonic() - start, 3),
            folders=folders if options.keep else None,
        )
    except CheckCommandError as err:
        if options.keep:  # where to look: every launch's output, beside its folder
            err.args = (f"{err.args[0]} (kept: the folders and every launch's output in {work})",)
        raise
    finally:
        if not options.keep:
            shutil.rmtree(work, ignore_errors=True)


def main_check(args: argparse.Namespace) -> int:
    """``dist-resume check``: exit 0 exact, 1 different, 2 when the command could not be checked (its lines shown)."""
    options = CheckOptions(
        interrupts=args.interrupts,
        seed=args.seed,
        timeout=args.timeout,
        signal=StopSignal.parse(args.signal),
        device=args.device,
        keep=args.keep,
        strict_extra=args.strict_extra,
    )
    try:
        result = run_check(args.command_argv, options)
    except CheckCommandError as err:
        tail = "".join(f"  | {line}\n" for line in err.stderr.splitlines())
        sys.stderr.write(f"dist-resume check: error: {err}\n" + (f"{err.run}'s last lines:\n{tail}" if tail else ""))
        sys.stderr.write("hint: run COMMAND by itself with an empty folder for {dir}; --keep keeps the check's logs\n")
        return ExitCode.INPUT
    if args.json:
        print_json(result.as_dict())
    elif not args.quiet:
        print(result.report())
    return ExitCode.OK if result.exact else ExitCode.DIFFERENT
