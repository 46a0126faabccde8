"""Real multi-process torch.distributed runs for tests, without picking ports.

``run_ranks`` forks ranks from a forkserver that preloaded torch (a launch costs milliseconds, each
child starts clean as with spawn) and joins them through a FileStore; ``run_torchrun`` and
``run_two_nodes`` launch the real torchrun. Timeouts nest: pg_timeout < deadline < pytest's 240 s.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import subprocess
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

import torch
import torch.distributed as dist

__all__ = ["LaunchTimeout", "RankFailure", "run_ranks", "run_torchrun", "run_two_nodes"]

REPO_ROOT = Path(__file__).resolve().parents[2]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed"])  # takes effect when the server starts


class RankFailure(AssertionError):
    """Some ranks raised, died or outlived the deadline. ``failures`` maps rank -> report."""

    def __init__(self, failures: dict[int, str], pids: dict[int, int], world_size: int) -> None:
        self.failures, self.pids = failures, pids
        parts = [f"{len(failures)} of {world_size} ranks failed: {sorted(failures)}"]
        parts += [f"----- rank {r} (pid {pids[r]}) -----\n{failures[r]}" for r in sorted(failures)]
        super().__init__("\n".join(parts))


class LaunchTimeout(AssertionError):
    """A torchrun launch outlived its timeout; its whole process tree was killed."""


def _child(rank: int, world_size: int, fn_name: tuple[str, str], args: tuple[Any, ...], store_path: str,
           backend: str, pg_timeout: float, env: dict[str, str], conn: Any) -> None:
    os.setsid()  # own process group: the parent can kill whatever this rank starts
    if str(REPO_ROOT) not in sys.path:  # so that ``tests.dist.xxx`` imports whatever the parent's path
        sys.path.insert(0, str(REPO_ROOT))
    os.environ.update(env)
    torch.set_num_threads(1)
    try:
        fn = getattr(importlib.import_module(fn_name[0]), fn_name[1])  # import errors land in the report
        store = dist.FileStore(store_path, world_size)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=pg_timeout))
        # gloo's init can return on one rank while a peer is still connecting its mesh; a rank that
        # then fails fast would break the peer's init. Start fn only once every rank is initialised.
        store.set(f"harness/initialised/{rank}", "1")
        store.wait([f"harness/initialised/{r}" for r in range(world_size)], timedelta(seconds=pg_timeout))
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


def _kill_group(pid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    for kill in (os.killpg, os.kill):  # the group if the process leads one, then the process itself
        try:
            kill(pid, sig)
        except ProcessLookupError:
            pass


def run_ranks(fn: Callable[..., Any], world_size: int, *, tmp_path: str | os.PathLike[str],
              args: Sequence[Any] = (), deadline: float = 90.0, pg_timeout: float = 30.0,
              backend: str = "gloo", env: Mapping[str, str] | None = None,
              nproc_per_node: int | None = None) -> list[Any]:
    """Run module-level ``fn(rank, world_size, *args)`` on ``world_size`` processes; return the
    results in rank order, or raise ``RankFailure`` naming every rank that raised, died or hung.

    Each child gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK as torchrun sets them
    (``nproc_per_node`` < world_size fakes several nodes: rank 2 of 2x2 has LOCAL_RANK 0, GROUP_RANK 1),
    then ``env`` on top, and an initialised process group; the parent's environment is never touched.
    torch is already imported when ``env`` is applied: variables read at import time do not apply.
    Results travel back with plain pickle, so tensors are fine (copied by value).
    """
    if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
        raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module")
    if not 0 < pg_timeout < deadline:
        raise ValueError(f"need 0 < pg_timeout < deadline, got pg_timeout={pg_timeout}, deadline={deadline}")
    per_node = nproc_per_node or world_size
    if world_size % per_node:
        raise ValueError(f"world_size={world_size} is not a multiple of nproc_per_node={per_node}")
    store_path = str(Path(tmp_path) / f"filestore-{uuid.uuid4().hex}")
    fn_name = (fn.__module__, fn.__qualname__)
    procs, readers = [], []
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    try:
        for rank in range(world_size):
            child_env = {"RANK": str(rank), "LOCAL_RANK": str(rank % per_node), "WORLD_SIZE": str(world_size),
                         "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
                         "OMP_NUM_THREADS": "1", **(env or {})}
            reader, writer = _CTX.Pipe(duplex=False)
            p = _CTX.Process(target=_child, name=f"rank{rank}", args=(  # not daemon: may fork workers
                rank, world_size, fn_name, tuple(args), store_path, backend, pg_timeout, child_env, writer))
            p.start()
            writer.close()
            procs.append(p)
            readers.append(reader)
        end = time.monotonic() + deadline
        pending = set(range(world_size))
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
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                _kill_group(p.pid)
        for p in procs:
            p.join(10)
        for r in readers:
            r.close()
    if failures:
        raise RankFailure(failures, {r: p.pid or -1 for r, p in enumerate(procs)}, world_size)
    return [results[r] for r in range(world_size)]


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}


def _descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (torchrun starts its workers in their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    _kill_group(proc.pid, signal.SIGSTOP)  # freeze the agent: no replacement workers
    for pid in [proc.pid, *_descendants(proc.pid)]:  # collect first: SIGKILL reparents the workers
        _kill_group(pid)
    proc.wait()


def _launch(cmds: list[list[str]], cwd: str | os.PathLike[str], env: Mapping[str, str] | None,
            timeout: float) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands at once, each in a new session, output to anonymous files (a pipe could fill up,
    or be held open by an orphan); on timeout kill every process tree and raise with the output tails."""
    files = [tuple(tempfile.TemporaryFile("w+", errors="replace") for _ in "oe") for _ in cmds]
    procs: list[subprocess.Popen[bytes]] = []
    end, timed_out = time.monotonic() + timeout, False
    try:
        for cmd, (out, err) in zip(cmds, files):
            procs.append(subprocess.Popen(cmd, cwd=cwd, env=_child_env(env), stdout=out, stderr=err,
                                          start_new_session=True))
        for p in procs:
            p.wait(timeout=max(0.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        for p in procs:
            if p.poll() is None:
                _kill_tree(p)
    outputs = [(_read(out), _read(err)) for out, err in files]
    if timed_out:
        tails = "\n".join(f"----- {' '.join(c)}\n[stdout]\n{o[-3000:]}\n[stderr]\n{e[-3000:]}"
                          for c, (o, e) in zip(cmds, outputs))
        raise LaunchTimeout(f"launch did not finish within {timeout:g}s; process trees killed\n{tails}")
    return [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, outputs)]


def _read(f: Any) -> str:
    with f:
        f.seek(0)
        return str(f.read())


def run_torchrun(script_args: list[str], *, nproc: int, cwd: str | os.PathLike[str],
                 env: Mapping[str, str] | None = None, timeout: float = 120.0,
                 extra_torchrun_args: Sequence[str] = ()) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=nproc [extra] *script_args``; never raises on a non-zero exit."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *extra_torchrun_args, *script_args]
    return _launch([cmd], cwd, env, timeout)[0]


def run_two_nodes(script_args: list[str], *, nproc_per_node: int = 2, cwd: str | os.PathLike[str],
                  env: Mapping[str, str] | None = None,
                  timeout: float = 180.0) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """Simulate a two-node torchrun job on this machine; return (node 0, node 1) results.

    This process hosts the c10d rendezvous TCPStore on an OS-assigned port for the whole run;
    ``is_host=false`` makes both agents connect to it as clients (torch's ``_create_tcp_store``
    honours an explicit ``is_host`` instead of guessing from the hostname). The c10d rendezvous
    ignores ``--node_rank``: GROUP_RANK follows sorted (address, agent pid), so check ranks as sets.
    """
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
        timeout=timedelta(seconds=timeout))
    try:  # the store lives until both agents are done
        common = ["--nnodes=2", f"--nproc_per_node={nproc_per_node}", "--rdzv-backend=c10d",
                  f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-conf=is_host=false",
                  f"--rdzv-id={uuid.uuid4().hex}", "--local-addr=127.0.0.1"]
        cmds = [[sys.executable, "-m", "torch.distributed.run", *common, f"--node_rank={n}", *script_args]
                for n in (0, 1)]
        node0, node1 = _launch(cmds, cwd, env, timeout)
    finally:
        del store
    return node0, node1
