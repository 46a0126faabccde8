"""The harness works, and it fails loudly: per-rank tracebacks, deadlines, no leftover processes."""

from __future__ import annotations

import os
import subprocess
import textwrap
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.dist.harness import LaunchTimeout, RankFailure, run_ranks, run_torchrun


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (PID 1 here may never reap orphans)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_dead(pids: list[int], within: float = 5.0) -> list[int]:
    end = time.monotonic() + within
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < end:
        time.sleep(0.05)
    return alive


# --- functions run in the children: module level, so the forkserver children can import them ---


def _all_reduce(rank: int, world_size: int, scale: int) -> dict:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    env = {
        k: os.environ[k]
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "DIST_TEST_MARK")
    }
    return {
        "sum": t.item() * scale,
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env": env,
        "pid": os.getpid(),
        "tensor": t,
    }  # a tensor must survive the trip back


def _mixed_outcomes(rank: int, world_size: int) -> object:
    if rank == 1:
        raise ValueError("boom from rank 1")
    if rank == 2:
        os._exit(7)
    if rank == 3:
        return lambda: None  # cannot be pickled back
    return "fine"


def _rank1_hangs(rank: int, world_size: int, pid_file: str) -> int:
    if rank == 1:
        sleeper = subprocess.Popen(["sleep", "600"])  # a grandchild: must die with its rank
        Path(pid_file).write_text(f"{os.getpid()} {sleeper.pid}")
        time.sleep(600)
    return rank


# --- run_ranks ---


def test_rejects_bad_timeouts_and_local_functions(tmp_path):
    with pytest.raises(ValueError, match="pg_timeout < deadline"):
        run_ranks(_all_reduce, 2, tmp_path=tmp_path, deadline=10, pg_timeout=10)

    def local(rank, world_size):
        return rank

    with pytest.raises(ValueError, match="module-level"):
        run_ranks(local, 2, tmp_path=tmp_path)


@pytest.mark.dist
def test_all_reduce_two_ranks_and_env(tmp_path):
    env_before = dict(os.environ)
    results = run_ranks(
        _all_reduce, 2, tmp_path=tmp_path, args=(10,), deadline=60, pg_timeout=20, env={"DIST_TEST_MARK": "x"}
    )
    assert [r["sum"] for r in results] == [30.0, 30.0]
    assert all(torch.equal(r["tensor"], torch.tensor([3.0])) for r in results)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    assert [r["env"] for r in results] == [
        {
            "RANK": str(i),
            "LOCAL_RANK": str(i),
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "DIST_TEST_MARK": "x",
        }
        for i in range(2)
    ]
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3
    assert dict(os.environ) == env_before
    assert not dist.is_initialized()


@pytest.mark.dist
def test_four_ranks_on_two_simulated_nodes(tmp_path):
    results = run_ranks(
        _all_reduce,
        4,
        tmp_path=tmp_path,
        args=(1,),
        nproc_per_node=2,
        deadline=60,
        pg_timeout=20,
        env={"DIST_TEST_MARK": "y"},
    )
    assert [r["sum"] for r in results] == [10.0] * 4
    assert [
        (r["env"]["RANK"], r["env"]["LOCAL_RANK"], r["env"]["GROUP_RANK"], r["env"]["LOCAL_WORLD_SIZE"])
        for r in results
    ] == [("0", "0", "0", "2"), ("1", "1", "0", "2"), ("2", "0", "1", "2"), ("3", "1", "1", "2")]


@pytest.mark.dist
def test_each_failed_rank_is_reported_with_its_traceback(tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ranks(_mixed_outcomes, 4, tmp_path=tmp_path, deadline=60, pg_timeout=20)
    failures = info.value.failures
    assert sorted(failures) == [1, 2, 3]
    assert "ValueError: boom from rank 1" in failures[1]
    assert "_mixed_outcomes" in failures[1] and "test_harness.py" in failures[1]  # where it was raised
    assert "exited with code 7" in failures[2]
    assert "unpicklable" in failures[3]
    message = str(info.value)
    assert "3 of 4 ranks failed: [1, 2, 3]" in message
    assert "----- rank 1 " in message and "boom from rank 1" in message
    assert _wait_dead(list(info.value.pids.values())) == []


@pytest.mark.dist
def test_hanging_rank_is_killed_at_the_deadline_with_its_children(tmp_path):
    pid_file = tmp_path / "rank1.pids"
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        run_ranks(_rank1_hangs, 2, tmp_path=tmp_path, args=(str(pid_file),), deadline=4, pg_timeout=2)
    assert time.monotonic() - start < 20
    assert sorted(info.value.failures) == [1]
    assert "deadline" in info.value.failures[1] and "----- rank 1 " in str(info.value)
    rank1_pid, sleeper_pid = map(int, pid_file.read_text().split())
    assert rank1_pid == info.value.pids[1]
    assert _wait_dead([*info.value.pids.values(), sleeper_pid]) == []


# --- torchrun ---

# run_torchrun and run_two_nodes are what every torchrun test launches through (tests/dist/test_launch.py,
# test_ddp_accelerator.py's two nodes, ...), the ranks' environment checked there; here, a launch that overstays


@pytest.mark.dist
def test_torchrun_timeout_kills_agent_and_workers(tmp_path):
    (tmp_path / "hang.py").write_text(
        textwrap.dedent("""
        import os, time
        open(f"worker{os.environ['LOCAL_RANK']}.pid", "w").write(str(os.getpid()))
        print("worker up", flush=True)
        time.sleep(600)
    """)
    )
    # the bound outlasts torchrun's start (its agent imports torch; the workers do not) with a margin for a busy machine
    with pytest.raises(LaunchTimeout, match="did not finish within 10s") as info:
        run_torchrun(["hang.py"], nproc=2, cwd=tmp_path, timeout=10)
    assert "worker up" in str(info.value)
    worker_pids = [int((tmp_path / f"worker{i}.pid").read_text()) for i in range(2)]
    assert _wait_dead(worker_pids) == []
