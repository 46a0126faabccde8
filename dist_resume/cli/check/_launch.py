"""One launch of COMMAND for ``dist-resume check``: in a session of its own, its output in files, its checkpoint
folder watched, stopped as a preemption stops a job, and nothing of it left running afterwards. Torch-free.

Every process of a launch carries ``DIST_RESUME_CHECK_RUN=<id>`` in its environment. A stop with SIGKILL freezes the
launch's process group, collects the whole tree below it (torchrun's workers run in sessions of their own, FACTS 37)
and kills it (:func:`~dist_resume._core.procs.kill_tree`); a stop with SIGTERM signals the launch's process group,
as ``kill -TERM -- -PGID`` does (torchrun forwards it to its workers), and kills the tree after :data:`TERM_GRACE_S`.
Whatever still carries the launch's id once it ended (a worker its agent left behind) is killed too.
"""

from __future__ import annotations

import enum
import errno
import re
import signal
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from ..._core.errors import CheckCommandError, UsageError
from ..._core.procs import kill_process_group, kill_tree, marked_processes
from ._watch import SETTLE_S, FolderWatch

__all__ = ["MARK_ENV", "POLL_S", "TERM_GRACE_S", "StopSignal", "StopRule", "Seen", "Launch", "launch", "stderr_tail"]

MARK_ENV: Final = "DIST_RESUME_CHECK_RUN"
POLL_S: Final = 0.02  # how often the folder and the process are looked at (a listing of a few names: microseconds)
TERM_GRACE_S: Final = 30.0  # after SIGTERM, how long a launch may take to stop by itself before SIGKILL
TAIL_LINES: Final = 20
_SCANNED: Final = 262144  # bytes of stderr searched for a worker's error above torchrun's summary
_TORCHRUN_SUMMARY: Final = "Root Cause (first observed failure):"
_ROOT_RANK: Final = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXCEPTION: Final = re.compile(r"^(?:\[rank(\d+)\]:\s*)?([A-Za-z_][\w.]*(?:Error|Exception|Exit)\b.*:.*)$")


class StopSignal(enum.Enum):
    """How an interruption stops the run: SIGKILL to the whole process tree (a preemption, a crash, an OOM kill), or
    SIGTERM to the launch's process group (a scheduler's notice: the script may save and exit)."""

    KILL = "KILL"
    TERM = "TERM"

    @classmethod
    def parse(cls, value: str | StopSignal) -> StopSignal:
        """``"KILL"``, ``"SIGKILL"``, ``"term"``, ... or a member."""
        if isinstance(value, StopSignal):
            return value
        name = str(value).upper().removeprefix("SIG")
        if name not in cls.__members__:
            raise UsageError(
                f"signal={value!r} is not one the check sends: use KILL (SIGKILL to the whole process tree, the "
                "default) or TERM (SIGTERM to the command's process group)",
                hint="--signal KILL or --signal TERM",
            )
        return cls[name]


@dataclass(frozen=True)
class StopRule:
    """When a launch is stopped: ``delay`` seconds after the ``checkpoints``-th checkpoint it wrote was complete, or
    as soon as the next one is, if that comes first (a launch faster than the reference stops where it should)."""

    checkpoints: int
    delay: float


@dataclass(frozen=True)
class Seen:
    """A checkpoint first seen complete ``seconds`` after its launch started: its ``name`` and ``step`` (from the name)."""

    seconds: float
    name: str
    step: int | None


@dataclass(frozen=True)
class Launch:
    """One launch: ``label`` ("reference", "launch 2"), wall ``seconds``, ``returncode`` (negative: the signal that
    ended it), ``stopped_at`` (seconds after its start when the check stopped it; None: it ended by itself), the
    checkpoints it wrote (``seen``) and the files holding its ``stdout`` and ``stderr``."""

    label: str
    seconds: float
    returncode: int | None
    stopped_at: float | None
    seen: tuple[Seen, ...]
    stdout: Path
    stderr: Path

    @property
    def failed(self) -> bool:
        """It ended by itself with a non-zero status."""
        return self.stopped_at is None and self.returncode != 0


def _read_end(path: Path, size: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - size))
        return f.read().decode(errors="replace")


def _worker_error(lines: list[str]) -> str | None:
    """The error a worker raised, above torchrun's failure summary (which names the rank but not the error): the
    last exception line of the summary's root-cause rank (``[rank0]: RuntimeError: ...``), else the last one that is
    not torchrun's own ``ChildFailedError``; None without a summary."""
    at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].strip() == _TORCHRUN_SUMMARY), None)
    if at is None:
        return None
    root = next((m.group(1) for line in lines[at + 1 :] if (m := _ROOT_RANK.match(line))), None)
    found: list[tuple[str | None, str]] = [
        (m.group(1), m.group(2))
        for line in lines[:at]
        if (m := _EXCEPTION.match(line)) and "ChildFailedError" not in m.group(2)
    ]
    rank, error = next((f for f in reversed(found) if f[0] == root), found[-1] if found else (None, ""))
    if not error:
        return None
    return f"the worker's error{f' (rank {rank})' if rank is not None else ''}: {error}"


def stderr_tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a launch's stderr (of its stdout when stderr is empty). Under torchrun, whose
    summary at the end names the failed rank but not its error, the worker's error found above the summary comes
    first."""
    for candidate in (path, path.with_suffix(".out")):
        try:
            text = _read_end(candidate, 16384)
        except OSError:
            continue
        if not text.strip():
            continue
        tail = text.rstrip().splitlines()[-lines:]
        if _TORCHRUN_SUMMARY in text:
            try:
                worker = _worker_error(_read_end(candidate, _SCANNED).splitlines())
            except OSError:
                worker = None
            tail = [worker, *tail] if worker else tail
        return "\n".join(tail)
    return ""


_START_HINTS: Final = {
    errno.ENOENT: "check its spelling and that it is on PATH (for a script: that the interpreter its #! line names "
    "exists), or run a script through its interpreter (python train.py)",
    errno.EACCES: "make it executable (chmod +x), or run it through its interpreter (python train.py, bash run.sh)",
    errno.ENOEXEC: "give the script a #! line (#!/usr/bin/env python), or run it through its interpreter "
    "(python train.py)",
}


def _not_started(argv: Sequence[str], cwd: Path | None, label: str, err: OSError) -> CheckCommandError:
    """COMMAND's program (or its working folder) could not be started: which, the OS's reason, and what to do."""
    reason = err.strerror or str(err)
    if cwd is not None and err.filename is not None and str(err.filename) == str(cwd):
        what, hint = f"its working folder {str(cwd)!r}", "give the check a folder that exists (cwd=)"
    else:
        what = f"{argv[0]!r}"
        hint = _START_HINTS.get(err.errno or 0, "check that it runs by itself, outside the check")
    return CheckCommandError(
        f"COMMAND could not be started for the {label} run: {what}: {reason}; {hint}", run=label, returncode=None
    )


def _kill(proc: subprocess.Popen[bytes], mark: str) -> None:
    kill_tree(proc.pid, also=marked_processes(MARK_ENV, mark))
    proc.wait()


def _due(stop: StopRule, seen: list[Seen], elapsed: float) -> bool:
    if len(seen) > stop.checkpoints:
        return True
    return len(seen) == stop.checkpoints and elapsed - seen[-1].seconds >= stop.delay


def _clean_up(mark: str) -> None:
    """Kill what outlived its launch (workers an agent left behind): each with its process group."""
    for pid in marked_processes(MARK_ENV, mark):
        kill_process_group(pid)


def launch(
    argv: Sequence[str],
    *,
    label: str,
    watch: FolderWatch,
    env: Mapping[str, str],
    cwd: Path | None,
    logs: Path,
    timeout: float | None,
    stop: StopRule | None = None,
    sig: StopSignal = StopSignal.KILL,
) -> Launch:
    """Run ``argv`` once and watch ``watch``'s folder. Local.

    ``stop``: stop it (with ``sig``) as the rule says, counting only checkpoints newer than those present at its
    start; None: let it end by itself. Raises
    :class:`~dist_resume.errors.CheckCommandError` when it runs past ``timeout`` seconds (it is killed first).
    """
    mark = uuid.uuid4().hex
    out, err = logs.with_suffix(".out"), logs.with_suffix(".err")
    start = time.monotonic()
    present = {(e.name, e.version) for e in watch.look(start)}  # complete or not: nothing here is new
    seen: list[Seen] = []
    stopped_at: float | None = None
    term_deadline: float | None = None  # after a SIGTERM: when the tree gets SIGKILL
    with open(out, "wb") as fo, open(err, "wb") as fe:
        try:
            proc = subprocess.Popen(
                list(argv),
                cwd=cwd,
                env={**env, MARK_ENV: mark},
                stdin=subprocess.DEVNULL,
                stdout=fo,
                stderr=fe,
                start_new_session=True,  # its own process group: a stop reaches it and nothing else
            )
        except OSError as error:  # no such program, not executable, no #! line, no such cwd
            raise _not_started(argv, cwd, label, error) from error
    ended_at: float | None = None
    try:
        while True:
            ended = proc.poll() is not None
            now = time.monotonic()
            pending = False  # a new entry not complete yet (a folder or file that must stay the same SETTLE_S)
            for entry in watch.look(now):
                if (entry.name, entry.version) in present:
                    continue
                first = watch.first_seen(entry)
                if first is None:
                    pending = True
                    continue
                present.add((entry.name, entry.version))
                seen.append(Seen(round(first - start, 3), entry.name, entry.step))
            if ended:
                ended_at = now if ended_at is None else ended_at
                # a run that ended by itself: what it saved last counts once it settled (a stopped one's is torn)
                if stopped_at is not None or not pending or now - ended_at > SETTLE_S + 2 * POLL_S:
                    break
                time.sleep(POLL_S)
                continue
            if timeout is not None and now - start > timeout:
                _kill(proc, mark)
                raise CheckCommandError(
                    f"the {label} run did not end within --timeout {timeout:g} s; it was killed. Give the check "
                    "a longer timeout, or look at what the command does at that point",
                    run=label,
                    stderr=stderr_tail(err),
                )
            if stopped_at is None and stop is not None and _due(stop, seen, now - start):
                stopped_at = round(now - start, 3)
                if sig is StopSignal.KILL:
                    _kill(proc, mark)
                    continue  # one more look at the folder, then out
                kill_process_group(proc.pid, signal.SIGTERM)
                term_deadline = now + TERM_GRACE_S
            if term_deadline is not None and now > term_deadline:
                _kill(proc, mark)
                continue
            time.sleep(POLL_S)
    finally:
        if proc.poll() is None:  # an exception (Ctrl-C) interrupted the watch: the launch goes with it
            _kill(proc, mark)
        _clean_up(mark)
    return Launch(label, round(time.monotonic() - start, 3), proc.returncode, stopped_at, tuple(seen), out, err)
