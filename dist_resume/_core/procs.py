"""Process trees: find every process below one, and stop or kill the whole tree. Local; no torch.

torchrun starts each worker in a session of its own, so a signal to torchrun's process group never reaches them: a
SIGKILL there leaves the workers training and writing checkpoints (FACTS 37). To stop a job as a preemption does,
:func:`kill_tree` freezes the root's group (no replacement workers), collects every descendant by walking the
parent ids in ``/proc/*/stat`` (collected first: a SIGKILL re-parents the children of the killed), then kills each
one with its own process group. On a system without ``/proc`` only the root's group is reached.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["descendants", "marked_processes", "kill_process_group", "kill_tree"]


def _parents() -> dict[int, list[int]]:
    """parent pid -> its children's pids, from ``/proc/*/stat`` (empty without ``/proc``)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:  # the command name may hold spaces and parentheses: the fields after the last ")" are fixed
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue  # exited meanwhile, or not ours to read
        children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children, ...), parents before children. Local."""
    children = _parents()
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def marked_processes(name: str, value: str) -> list[int]:
    """The processes whose environment holds ``name=value``: a launch's processes, also those re-parented after
    their parent died. Local; only processes of this user are readable (none without ``/proc``), and a process in
    the middle of its exec reads as having no environment for that instant."""
    mark = f"{name}={value}".encode()
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark in environ.read_bytes().split(b"\0"):
                found.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return [pid for pid in found if pid != os.getpid()]


def kill_process_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to the process group ``pid`` leads (if it leads one), then to ``pid`` itself. Local.

    A process that is gone, or not ours, is skipped without an error.
    """
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(pid: int, *, also: list[int] | None = None) -> list[int]:
    """SIGKILL ``pid``, every process below it and each one's process group; return the pids killed. Local.

    The root's process group is stopped first (SIGSTOP), so that an agent such as torchrun starts no replacement
    while its tree is collected; then every process, root first, is killed with its group (torchrun's workers lead
    sessions of their own). ``also``: more pids to kill the same way (e.g. what ``marked_processes`` found: processes
    re-parented after their parent died). Reap ``pid`` afterwards if it is your child (``Popen.wait()``).

    Example (a launcher whose worker runs in a session of its own, as torchrun's do)::

        >>> import subprocess, sys, time
        >>> code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); time.sleep(60)"
        >>> launcher = subprocess.Popen([sys.executable, "-c", code], start_new_session=True); time.sleep(1)
        >>> len(kill_tree(launcher.pid)), launcher.wait()
        (2, -9)
    """
    kill_process_group(pid, signal.SIGSTOP)
    tree = [pid, *descendants(pid)]
    tree += [p for p in also or () if p not in tree]
    for member in tree:
        kill_process_group(member)
    return tree
