"""The fuzz run's worker pool: long-lived worker processes (``_fuzz_worker``), one case each at a time, a case over
its time limit killing and replacing its worker; a case's outcome as the worker reports it, or ``crash``, ``hang``
and ``memory`` as the pool sees them."""

from __future__ import annotations

import multiprocessing as mp
import pkgutil
import shutil
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from _fuzz_worker import worker_main

import dist_resume

BAD = ("escape", "crash", "hang", "memory", "half-restore", "late")
MEMORY_SLACK_KIB = 256 << 10
_CTX = mp.get_context("forkserver")
# imported once by the fork server, before any worker forks: torch._dynamo (3 s here, imported lazily by the first
# optimizer step) and every dist_resume module (the readers import theirs lazily) would otherwise cost each worker
# that much at its first case
# modules whose import does something: __main__ runs the CLI; the test accelerator's plugin and start-up modules boot
# it (its autograd threads: a worker forked after them cannot run backward)
_NO_PRELOAD = ("__main__", "sitecustomize", "testing.sim.plugin")
PRELOAD = [
    "torch",
    "torch._dynamo",
    "numpy",
    *(m.name for m in pkgutil.walk_packages(dist_resume.__path__, "dist_resume.") if not m.name.endswith(_NO_PRELOAD)),
    "_fuzz_corpus",
    "_fuzz_worker",
]


@dataclass
class Case:
    id: int
    corpus: str
    mutation: str
    path: str
    data: bytes
    original: Path
    member: str = ""  # the file of a folder case that was mutated (or deleted)
    deleted: bool = False
    target: Path = field(default=Path())

    @property
    def source_file(self) -> Path:
        """The unmutated file this case's bytes came from."""
        return self.original / self.member if self.member else self.original


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    scratch: Path
    case: Case | None = None
    deadline: float = 0.0


class Pool:
    """Long-lived workers; a case over its time limit kills and replaces its worker."""

    def __init__(self, jobs: int, timeout: float, root: Path) -> None:
        self.timeout, self.root = timeout, root
        _CTX.set_forkserver_preload(PRELOAD)
        self.workers = [self._start(i) for i in range(jobs)]
        self.started = jobs

    def _start(self, slot: int) -> _Worker:
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=worker_main, args=(child,), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(120):
            raise RuntimeError("a fuzz worker did not start within 120 s")
        parent.recv()
        scratch = self.root / f"w{slot}-{proc.pid}"
        scratch.mkdir(parents=True)
        return _Worker(proc, parent, scratch)

    def _replace(self, i: int) -> None:
        old = self.workers[i]
        if old.proc.is_alive():
            old.proc.kill()
        old.proc.join(10)
        old.conn.close()
        shutil.rmtree(old.scratch, ignore_errors=True)
        self.workers[i] = self._start(i)
        self.started += 1

    def _submit(self, w: _Worker, case: Case) -> None:
        for old in w.scratch.iterdir():  # what the previous case wrote (outputs, folders)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        if case.member:
            case.target = w.scratch / case.original.name
            shutil.copytree(case.original, case.target)
            if case.deleted:
                (case.target / case.member).unlink()
            else:
                (case.target / case.member).write_bytes(case.data)
        else:
            case.target = w.scratch / f"case{case.original.suffix}"
            case.target.write_bytes(case.data)
        w.case, w.deadline = case, time.monotonic() + self.timeout
        w.conn.send(
            {
                "id": case.id,
                "path": case.path,
                "target": str(case.target),
                "original": str(case.original),
                "scratch": str(w.scratch),
                "corpus": case.corpus,
            }
        )

    def run(self, cases: list[Case]) -> list[tuple[Case, dict[str, Any]]]:
        todo, done = list(reversed(cases)), []
        while todo or any(w.case for w in self.workers):
            for w in self.workers:
                if w.case is None and todo:
                    self._submit(w, todo.pop())
            busy = [w for w in self.workers if w.case is not None]
            now = time.monotonic()
            ready = wait(
                [w.conn for w in busy] + [w.proc.sentinel for w in busy],
                timeout=max(0.0, min(w.deadline for w in busy) - now),
            )
            for i, w in enumerate(self.workers):
                case = w.case
                if case is None:
                    continue
                result: dict[str, Any] | None = None
                if w.conn in ready:
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        result = None
                if result is None and (w.conn in ready or w.proc.sentinel in ready):
                    w.proc.join(5)
                    code = w.proc.exitcode
                    result = {"outcome": "crash", "type": f"signal {-code}" if code and code < 0 else f"exit {code}"}
                    self._replace(i)
                elif result is None and time.monotonic() >= w.deadline:
                    result = {"outcome": "hang", "type": f"over {self.timeout:g}s"}
                    self._replace(i)
                if result is None:
                    continue
                bound = 2 * len(case.data) // 1024 + MEMORY_SLACK_KIB
                if result["outcome"] not in BAD and result.get("peak_kib", 0) > bound:
                    result = {**result, "outcome": "memory", "type": f"peak {result['peak_kib'] >> 10} MiB"}
                self.workers[i].case = None
                done.append((case, result))
                if result["outcome"] == "memory" and self.workers[i].proc.is_alive():
                    self._replace(i)  # a fresh ru_maxrss for the next cases
        return done

    def close(self) -> None:
        for w in self.workers:
            w.conn.close()
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)


def run_all(cases: list[Case], jobs: int, timeout: float, scratch: Path) -> list[tuple[Case, dict[str, Any]]]:
    """Every case through a worker pool, results in case order."""
    pool = Pool(jobs, timeout, scratch)
    try:
        return sorted(pool.run(cases), key=lambda cr: cr[0].id)
    finally:
        pool.close()
