"""Real multi-process torch.distributed runs for tests, without picking ports.

``run_ranks`` is ``dist_resume.testing.run_ranks`` (ranks forked from a forkserver that preloaded
torch and torch._dynamo, joined through a FileStore) with the tests' timeouts; ``run_torchrun`` and
``run_two_nodes`` launch the real torchrun. Timeouts nest: pg_timeout < deadline < pytest's 240 s.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dist_resume import testing
from dist_resume.testing import RankFailure, kill_tree

__all__ = ["LaunchTimeout", "RankFailure", "run_ranks", "run_torchrun", "run_two_nodes"]

REPO_ROOT = Path(__file__).resolve().parents[2]


class LaunchTimeout(AssertionError):
    """A torchrun launch outlived its timeout; its whole process tree was killed."""


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *,
    tmp_path: str | os.PathLike[str],
    args: Sequence[Any] = (),
    deadline: float = 90.0,
    pg_timeout: float = 30.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
    nproc_per_node: int | None = None,
) -> list[Any]:
    """``dist_resume.testing.run_ranks`` with the tests' defaults: FileStore in ``tmp_path``,
    ``deadline`` 90 s, ``pg_timeout`` 30 s (under pytest's 240 s). Raises ``RankFailure``."""
    return testing.run_ranks(
        fn,
        world_size,
        args=args,
        timeout=deadline,
        pg_timeout=pg_timeout,
        backend=backend,
        env=env,
        nproc_per_node=nproc_per_node,
        tmp_dir=tmp_path,
    )


def _child_env(env: Mapping[str, str] | None) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(env or {})}


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """The launch and every process below it (torchrun starts its workers in their own sessions): the library's
    whole-tree kill, then reap the launch."""
    kill_tree(proc.pid)
    proc.wait()


def _launch(
    cmds: list[list[str]], cwd: str | os.PathLike[str], env: Mapping[str, str] | None, timeout: float
) -> list[subprocess.CompletedProcess[str]]:
    """Run the commands at once, each in a new session, output to anonymous files (a pipe could fill up,
    or be held open by an orphan); on timeout kill every process tree and raise with the output tails."""
    files = [tuple(tempfile.TemporaryFile("w+", errors="replace") for _ in "oe") for _ in cmds]
    procs: list[subprocess.Popen[bytes]] = []
    end, timed_out = time.monotonic() + timeout, False
    try:
        for cmd, (out, err) in zip(cmds, files):
            procs.append(
                subprocess.Popen(cmd, cwd=cwd, env=_child_env(env), stdout=out, stderr=err, start_new_session=True)
            )
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
        tails = "\n".join(
            f"----- {' '.join(c)}\n[stdout]\n{o[-3000:]}\n[stderr]\n{e[-3000:]}" for c, (o, e) in zip(cmds, outputs)
        )
        raise LaunchTimeout(f"launch did not finish within {timeout:g}s; process trees killed\n{tails}")
    return [subprocess.CompletedProcess(c, p.returncode, o, e) for c, p, (o, e) in zip(cmds, procs, outputs)]


def _read(f: Any) -> str:
    with f:
        f.seek(0)
        return str(f.read())


def run_torchrun(
    script_args: list[str],
    *,
    nproc: int,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    extra_torchrun_args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node=nproc [extra] *script_args``; never raises on a non-zero exit."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *extra_torchrun_args,
        *script_args,
    ]
    return _launch([cmd], cwd, env, timeout)[0]


def run_two_nodes(
    script_args: list[str],
    *,
    nproc_per_node: int = 2,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    node_env: Sequence[Mapping[str, str]] = ({}, {}),
    timeout: float = 180.0,
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """Simulate a two-node torchrun job on this machine; return (node 0, node 1) results.

    This process hosts the c10d rendezvous TCPStore on an OS-assigned port for the whole run;
    ``is_host=false`` makes both agents connect to it as clients (torch's ``_create_tcp_store``
    honours an explicit ``is_host`` instead of guessing from the hostname). The c10d rendezvous
    ignores ``--node_rank``: GROUP_RANK follows sorted (address, agent pid), so check ranks as sets.
    ``node_env[n]`` is added to node n's environment (e.g. its own ``CUDA_VISIBLE_DEVICES``).
    """
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True, timeout=timedelta(seconds=timeout)
    )
    try:  # the store lives until both agents are done
        common = [
            "--nnodes=2",
            f"--nproc_per_node={nproc_per_node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{store.port}",
            "--rdzv-conf=is_host=false",
            f"--rdzv-id={uuid.uuid4().hex}",
            "--local-addr=127.0.0.1",
        ]
        cmds = [
            [
                "env",
                *(f"{name}={value}" for name, value in node_env[n].items()),
                sys.executable,
                "-m",
                "torch.distributed.run",
                *common,
                f"--node_rank={n}",
                *script_args,
            ]
            for n in (0, 1)
        ]
        node0, node1 = _launch(cmds, cwd, env, timeout)
    finally:
        del store
    return node0, node1
