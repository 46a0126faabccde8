"""``run_ranks``: a function on N real torch.distributed processes (see :mod:`dist_resume.testing`)."""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from .._core.procs import kill_process_group

__all__ = ["RankFailure", "run_ranks"]

# what the fork server imports once, so that each rank forked from it starts warm: torch, and torch._dynamo, which
# building the first optimizer imports (as long again as torch itself). dist_resume is left to the ranks: a module
# the server imported has its top-level lines run there, where a coverage measurement of the ranks never sees them.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]
EXIT_GRACE = 5.0  # seconds a rank that reported gets to exit on its own


class RankFailure(AssertionError):
    """Some ranks raised, died or outlived the deadline.

    ``failures`` maps rank -> report (the traceback, the exit code, or the deadline); ``pids`` maps
    every rank to its process id. An ``AssertionError``, so test runners show it as a test failure.
    """

    def __init__(self, failures: dict[int, str], pids: dict[int, int], world_size: int) -> None:
        self.failures, self.pids, self.world_size = failures, pids, world_size
        parts = [f"{len(failures)} of {world_size} ranks failed: {sorted(failures)}"]
        parts += [f"----- rank {r} (pid {pids[r]}) -----\n{failures[r]}" for r in sorted(failures)]
        super().__init__("\n".join(parts))

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.failures, self.pids, self.world_size))


def _child(
    rank: int,
    world_size: int,
    fn_name: tuple[str, str],
    args: tuple[Any, ...],
    store_path: str,
    backend: str | None,
    pg_timeout: float,
    env: dict[str, str],
    sys_path: list[str],
    conn: Any,
) -> None:
    os.setsid()  # own process group: the parent can kill whatever this rank starts
    sys.path[:0] = [p for p in sys_path if p not in sys.path]  # import fn from wherever the parent could
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun's OMP_NUM_THREADS=1 for several ranks
    try:
        fn = _resolve(fn_name)  # import errors land in the report
        if backend is not None:
            store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
            timeout = timedelta(seconds=pg_timeout)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
            # gloo's init can return on one rank while a peer is still connecting its mesh; a rank that
            # then fails fast would break the peer's init. Start fn only once every rank is initialised.
            store.set(f"run_ranks/initialised/{rank}", "1")
            store.wait([f"run_ranks/initialised/{r}" for r in range(world_size)], timeout)
        msg: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:
        msg = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Plain pickle: Connection.send would use torch's ForkingPickler reducers, which pass tensors as
    # shared-memory fds that the parent can fetch only while this process is still alive.
    try:
        data = pickle.dumps(msg)
    except Exception:
        data = pickle.dumps(("error", f"rank {rank} returned an unpicklable value:\n{traceback.format_exc()}"))
    conn.send_bytes(data)
    conn.close()


def _resolve(fn_name: tuple[str, str]) -> Callable[..., Any]:
    obj: Any = importlib.import_module(fn_name[0])
    for part in fn_name[1].split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _context(start_method: str) -> Any:
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server starts: each fork starts warm
    return ctx


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    timeout: float = 90.0,
    pg_timeout: float | None = None,
    backend: str | None = "gloo",
    env: Mapping[str, str] | None = None,
    nproc_per_node: int | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    start_method: str = "forkserver",
    on_start: Callable[[int, int], None] | None = None,
) -> list[Any]:
    """Run module-level ``fn(rank, world_size, *args)`` on ``world_size`` new processes; results in rank order.

    Local (call it from one ordinary process, e.g. a test); the ranks it starts run the collectives.
    Each rank gets torchrun's variables (``nproc_per_node`` below ``world_size`` fakes several nodes:
    rank 2 of 2x2 has ``LOCAL_RANK`` 0, ``GROUP_RANK`` 1), then ``env`` on top, ``OMP_NUM_THREADS=1``
    and, unless ``backend`` is None, an initialised process group whose ``pg_timeout`` (default a
    third of ``timeout``) is shorter than the ``timeout`` deadline. Every rank starts ``fn`` only
    once all are initialised. This process's environment is never touched; torch is already
    imported when ``env`` is applied, so variables torch reads at import time do not apply.

    The rendezvous ``FileStore`` lives in ``tmp_dir`` (a private temporary folder by default).
    ``start_method`` is a multiprocessing start method: ``forkserver`` (default; torch and
    torch._dynamo are imported once, in the fork server, so a launch costs milliseconds) or
    ``spawn`` (each rank a fresh interpreter, e.g. for memory measurements). ``on_start(rank, pid)`` is called as each rank starts (to watch it from
    outside). Results travel back with plain pickle: tensors arrive copied. Each rank runs in its own
    process group; a rank that reported gets up to ``EXIT_GRACE`` (5 s, within the deadline) to exit
    on its own (multiprocessing's finalizers run then), and what is left after that, on failure or at
    the deadline, is killed with SIGKILL with its group, so nothing a rank started survives.

    Raises :class:`RankFailure` naming every rank that raised (with its traceback), exited without a
    result or outlived the deadline; ``ValueError`` for a local function, inconsistent timeouts or a
    ``tmp_dir`` that is not an existing folder.

    Example::

        >>> def add_ranks(rank, world_size):  # in an importable module
        ...     t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); return t.item()
        >>> run_ranks(add_ranks, 2)  # doctest: +SKIP
        [3.0, 3.0]
    """
    if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module")
    pg_timeout = timeout / 3 if pg_timeout is None else pg_timeout
    if not 0 < pg_timeout < timeout:
        raise ValueError(f"need 0 < pg_timeout < deadline, got pg_timeout={pg_timeout}, deadline={timeout}")
    per_node = nproc_per_node or world_size
    if world_size < 1 or world_size % per_node:
        raise ValueError(f"world_size={world_size} is not a positive multiple of nproc_per_node={per_node}")
    if tmp_dir is not None and not Path(tmp_dir).is_dir():  # the ranks would wait on their FileStore forever
        raise ValueError(f"tmp_dir={str(tmp_dir)!r} is not an existing folder; create it first or leave tmp_dir unset")
    with tempfile.TemporaryDirectory(prefix="run_ranks.") as own_dir:
        store_path = str(Path(tmp_dir if tmp_dir is not None else own_dir) / f"filestore-{uuid.uuid4().hex}")
        return _launch(
            fn, world_size, per_node, tuple(args), timeout, pg_timeout, backend, env, store_path, start_method, on_start
        )


def _launch(
    fn: Callable[..., Any],
    world_size: int,
    per_node: int,
    args: tuple[Any, ...],
    deadline: float,
    pg_timeout: float,
    backend: str | None,
    env: Mapping[str, str] | None,
    store_path: str,
    start_method: str,
    on_start: Callable[[int, int], None] | None,
) -> list[Any]:
    ctx = _context(start_method)
    fn_name = (fn.__module__, fn.__qualname__)
    procs: list[Any] = []
    readers: list[Any] = []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for rank in range(world_size):
            child_env = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % per_node),
                "WORLD_SIZE": str(world_size),
                "LOCAL_WORLD_SIZE": str(per_node),
                "GROUP_RANK": str(rank // per_node),
                "OMP_NUM_THREADS": "1",
                **(env or {}),
            }
            reader, writer = ctx.Pipe(duplex=False)
            child_args = (rank, world_size, fn_name, args, store_path, backend, pg_timeout, child_env, sys.path, writer)
            p = ctx.Process(target=_child, name=f"rank{rank}", args=child_args)  # not daemon: may fork workers
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
            if on_start is not None:
                on_start(rank, p.pid)
        end = _collect(procs, readers, deadline, results, failures)
        # a rank that reported still has its exit to run (multiprocessing's finalizers, where a coverage tool writes
        # the rank's data): wait for it, up to EXIT_GRACE and never past the deadline, before killing what is left
        exit_by = min(end, time.monotonic() + EXIT_GRACE)
        for p in procs:
            p.join(max(0.0, exit_by - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                kill_process_group(p.pid)
        for p in procs:
            p.join(10)
        for r in readers:
            r.close()
    if failures:
        raise RankFailure(failures, {r: p.pid or -1 for r, p in enumerate(procs)}, world_size)
    return [results[r] for r in range(world_size)]


def _collect(
    procs: list[Any], readers: list[Any], deadline: float, results: dict[int, Any], failures: dict[int, str]
) -> float:
    """Each rank's result or failure into ``results``/``failures``; returns the deadline (a ``time.monotonic()``)."""
    end = time.monotonic() + deadline
    pending = set(range(len(procs)))
    while pending and (left := end - time.monotonic()) > 0:
        waitables: dict[Any, int] = {readers[r]: r for r in pending} | {procs[r].sentinel: r for r in pending}
        for ready in wait(list(waitables), timeout=left):
            rank = waitables[ready]
            if rank not in pending:
                continue
            pending.discard(rank)
            try:
                status, value = pickle.loads(readers[rank].recv_bytes())
            except EOFError:  # exited without reporting: killed, segfault, os._exit
                procs[rank].join(5)
                failures[rank] = f"exited with code {procs[rank].exitcode} without reporting a result"
                continue
            except Exception:
                status, value = "error", f"result could not be unpickled:\n{traceback.format_exc()}"
            (results if status == "ok" else failures)[rank] = value
    for rank in pending:
        failures[rank] = f"still running at the {deadline:g}s deadline; killed with SIGKILL"
    return end
