"""Process plumbing for scripts/bench.py: /proc readers, a memory sampler, and a launcher for ranks.

The parent never holds the big tensors. Every measurement runs in fresh ``spawn`` processes started by
``dist_resume.testing.run_ranks`` (joined through a FileStore when there is more than one, or when
the body needs a process group); the
parent polls ``/proc/<pid>/status`` of each child every ``interval`` seconds from a thread, so the
sampling costs the measured processes nothing (no GIL, no thread of theirs). Bodies report the
``time.monotonic()`` windows they care about; CLOCK_MONOTONIC is system-wide, so the parent picks
the samples that fall inside each window.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from dist_resume.testing import run_ranks

__all__ = ["proc_status_kib", "proc_io", "Sampler", "launch", "Launched"]


def proc_status_kib(pid: int | str = "self", fields: Sequence[str] = ("RssAnon", "RssFile")) -> dict[str, int]:
    """The given ``/proc/<pid>/status`` fields, in KiB (missing when the process is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in fields:
                    out[name] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return out


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """``/proc/<pid>/io`` as a dict (rchar, wchar, syscr, syscw, read_bytes, write_bytes, ...)."""
    with open(f"/proc/{pid}/io") as f:
        return {name: int(value) for name, value in (line.split(":") for line in f)}


class Sampler:
    """Polls RssAnon and RssFile of some pids from a parent thread; answers peaks over time windows."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self._pids: list[int] = []
        self._samples: dict[int, list[tuple[float, int, int]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)

    def add(self, pid: int) -> None:
        self._samples.setdefault(pid, [])
        self._pids = [*self._pids, pid]  # replaced, never mutated: the thread iterates a snapshot

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._pids:
                got = proc_status_kib(pid)
                if got:
                    self._samples[pid].append((time.monotonic(), got["RssAnon"], got["RssFile"]))
            time.sleep(self.interval)

    def peak(self, pid: int, start: float, end: float) -> dict[str, Any]:
        """Highest RssAnon and RssFile (KiB) sampled in [start, end], and how many samples that was."""
        inside = [s for s in self._samples.get(pid, []) if start <= s[0] <= end]
        return {
            "anon_kib": max((s[1] for s in inside), default=0),
            "file_kib": max((s[2] for s in inside), default=0),
            "samples": len(inside),
        }


class Launched:
    """Results (rank order) of one launch, its pids, and the sampler that watched them."""

    def __init__(self, results: list[Any], pids: list[int], sampler: Sampler) -> None:
        self.results, self.pids, self.sampler = results, pids, sampler

    def peak(self, rank: int, window: tuple[float, float]) -> dict[str, Any]:
        return self.sampler.peak(self.pids[rank], *window)


def launch(
    fn: Callable[..., Any],
    world_size: int = 1,
    args: Sequence[Any] = (),
    *,
    use_pg: bool | None = None,
    timeout: float = 600.0,
    interval: float = 0.002,
) -> Launched:
    """Run module-level ``fn(rank, world_size, *args)`` in ``world_size`` fresh spawn processes.

    ``dist_resume.testing.run_ranks`` launches them (the one launcher tests and benchmarks share):
    a gloo process group joins them through a FileStore when ``world_size > 1`` (or ``use_pg``);
    each rank is watched by the sampler from the moment it starts. Raises ``RankFailure`` with each
    failed rank's traceback; at ``timeout`` every rank's process group is killed.
    """
    use_pg = world_size > 1 if use_pg is None else use_pg
    sampler = Sampler(interval)
    pids: dict[int, int] = {}

    def started(rank: int, pid: int) -> None:
        pids[rank] = pid
        sampler.add(pid)

    with sampler:
        results = run_ranks(
            fn,
            world_size,
            args=args,
            timeout=timeout,
            pg_timeout=timeout / 2,
            backend="gloo" if use_pg else None,
            start_method="spawn",  # fresh interpreters: memory baselines owe nothing to a forkserver
            on_start=started,
        )
    return Launched(results, [pids[r] for r in range(world_size)], sampler)
