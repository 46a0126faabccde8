"""Who holds a write lease on an object store, and whether a relaunch may take it over at once.

An object store cannot tell that the process holding a lease died, as the kernel drops a dead process's ``flock``:
the lease says who wrote it, and the next writer judges from that (:func:`takeover_reason`). It takes the lease over
at once when

- its holder was an earlier generation of the same torchrun job: the same ``TORCHELASTIC_RUN_ID`` and a smaller
  ``TORCHELASTIC_RESTART_COUNT`` (torchrun starts a generation only once it stopped the previous one's workers; a run
  id of ``none``, torchrun's default without ``--rdzv-id`` or ``--standalone``, names no job), unless the holder is a
  live process of this host; or
- its holder ran on this host (the same host name, boot and pid namespace) and its process is gone: no such pid, a
  zombie, or a pid reused by a process started at another time (``/proc/<pid>/stat``).

Anything else (another host, another job, a live process) may be alive: the next writer waits for the lease to be
released or to expire. Local; torch-free.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from dataclasses import dataclass

__all__ = ["Holder", "this_process", "takeover_reason", "process_gone"]


@dataclass(frozen=True)
class Holder:
    """A process that holds (or wants) a lease, as the lease object names it."""

    host: str
    pid: int
    node: str | None = None  # boot id and pid namespace: the processes whose pids this host's /proc shows
    start: int | None = None  # the process's start time (clock ticks after boot), against a reused pid
    job: str | None = None  # TORCHELASTIC_RUN_ID
    generation: int | None = None  # TORCHELASTIC_RESTART_COUNT

    def same_host(self, other: Holder) -> bool:
        """Whether ``other``'s pid can be checked here: the same host, boot and pid namespace."""
        return self.node is not None and self.host == other.host and self.node == other.node

    def describe(self) -> str:
        job = ""
        if self.job is not None:
            job = f", torchrun job {self.job}" + ("" if self.generation is None else f" generation {self.generation}")
        return f"host {self.host}, pid {self.pid}{job}"


@functools.cache
def _node() -> str | None:
    if sys.platform != "linux":
        return ""  # no pid namespaces: the host name tells the host
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:  # /proc hidden: never judge another process by its pid
        return None


def _stat(pid: int) -> tuple[str, int] | None:
    """The state letter and start time of ``pid`` from ``/proc/<pid>/stat``; None where there is no such process.
    Raises ``OSError`` where ``/proc`` cannot tell."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except FileNotFoundError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name, in parentheses, may hold spaces
    return fields[0], int(fields[19])


def _start_time(pid: int) -> int | None:
    if sys.platform != "linux":
        return None
    try:
        stat = _stat(pid)
    except (OSError, ValueError, IndexError):
        return None
    return None if stat is None else stat[1]


def this_process() -> Holder:
    """This process, as a lease names it (its job from torchrun's environment)."""
    job = os.environ.get("TORCHELASTIC_RUN_ID", "").strip()
    try:
        generation: int | None = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", ""))
    except ValueError:
        generation = None
    pid = os.getpid()
    return Holder(
        socket.gethostname(),
        pid,
        _node(),
        _start_time(pid),
        job if job and job != "none" else None,
        generation if job and job != "none" else None,
    )


def process_gone(holder: Holder) -> bool:
    """Whether ``holder``, a process of this host, is gone: no such pid, a zombie, or a pid reused since."""
    if holder.pid <= 0:
        return False  # not a process: os.kill(0, ...) would mean this process group
    if sys.platform == "linux":
        try:
            stat = _stat(holder.pid)
        except (OSError, ValueError, IndexError):
            return False  # /proc cannot tell: alive, for all we know
        if stat is not None:
            state, start = stat
            return state in ("Z", "X", "x") or (holder.start is not None and start != holder.start)
    try:  # no /proc entry (or no /proc): a process /proc hides from this user (hidepid) still answers EPERM
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def takeover_reason(holder: Holder, me: Holder) -> str | None:
    """Why ``me`` may take over the unexpired lease of ``holder`` at once, or None: wait for it (see the module)."""
    if me.same_host(holder) and holder.pid == me.pid:
        return None  # this very process: another manager holds it
    local = me.same_host(holder)
    if (
        holder.job is not None
        and holder.job == me.job
        and holder.generation is not None
        and me.generation is not None
        and holder.generation < me.generation
        and not (local and not process_gone(holder))
    ):
        return f"torchrun restarted its job {me.job} (generation {holder.generation}, now {me.generation})"
    if local and process_gone(holder):
        return f"its process (pid {holder.pid}) is gone from this host"
    return None
