"""Process plumbing for scripts/bench.py: /proc readers, a memory sampler, and a launcher for ranks.

The parent never holds the big tensors. Every measurement runs in fresh ``spawn`` processes (joined
through a FileStore when there is more than one, or when the body needs a process group); the
parent polls ``/proc/<pid>/status`` of each child every ``interval`` seconds from a thread, so the
sampling costs the measured processes nothing (no GIL, no thread of theirs). Bodies report the
``time.monotonic()`` windows they care about; CLOCK_MONOTONIC is system-wide, so the parent picks
the samples that fall inside each window.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

__all__ = ["proc_status_kib", "proc_io", "Sampler", "launch", "Launched"]

_CTX = mp.get_context("spawn")


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


def _entry(
    fn: Callable[..., Any], rank: int, world_size: int, store_path: str, use_pg: bool, args: tuple[Any, ...], conn: Any
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun sets OMP_NUM_THREADS=1 for several ranks; also 2 cores here
    try:
        if use_pg:
            store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300)
            )
        msg: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        msg = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


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

    A gloo process group joins them through a FileStore in a private temporary folder when
    ``world_size > 1`` (or ``use_pg``). Raises RuntimeError with each failed rank's traceback;
    processes still alive at ``timeout`` are killed (by their own pid).
    """
    use_pg = world_size > 1 if use_pg is None else use_pg
    sampler = Sampler(interval)
    procs, readers = [], []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    with tempfile.TemporaryDirectory(prefix="bench-store.") as store_dir, sampler:
        store_path = str(Path(store_dir) / "store")
        try:
            for rank in range(world_size):
                reader, writer = _CTX.Pipe(duplex=False)
                p = _CTX.Process(
                    target=_entry,
                    args=(fn, rank, world_size, store_path, use_pg, tuple(args), writer),
                    name=f"bench-rank{rank}",
                )
                p.start()
                writer.close()
                assert p.pid is not None
                sampler.add(p.pid)
                procs.append(p)
                readers.append(reader)
            end = time.monotonic() + timeout
            pending = set(range(world_size))
            while pending and (left := end - time.monotonic()) > 0:
                by_reader = {readers[r]: r for r in pending}
                for ready in wait(list(by_reader), timeout=left):
                    rank = by_reader[ready]  # type: ignore[index]
                    pending.discard(rank)
                    try:
                        status, value = pickle.loads(readers[rank].recv_bytes())
                    except EOFError:
                        status, value = "error", f"exited with code {procs[rank].exitcode} without a result"
                    (results if status == "ok" else failures)[rank] = value
            for rank in pending:
                failures[rank] = f"still running after {timeout:g}s; killed"
        finally:
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, 9)
            for p in procs:
                p.join(30)
            for r in readers:
                r.close()
    if failures:
        reports = (f"----- rank {r} of {fn.__name__} -----\n{text}" for r, text in sorted(failures.items()))
        raise RuntimeError("\n".join(reports))
    return Launched([results[r] for r in range(world_size)], [p.pid or -1 for p in procs], sampler)
