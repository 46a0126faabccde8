"""A collective call made on some ranks only is named within seconds, and never stops a correct job.

tests/dist/checkin_script.py is a DDP script as users write it, run under torchrun with 2 ranks: rank 0 arrives late
to a correct save (an evaluation before it), then calls the manager's save inside ``if rank == 0:``. The rank
functions under run_ranks check what needs no script: two ranks in different calls, the bound taken from the process
group's timeout or the manager's ``collective_timeout``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_resume as dr
from dist_resume.testing import kill_tree
from tests.dist.harness import REPO_ROOT, run_ranks, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/dist/checkin_script.py")
FIX = "call it on every rank, not inside `if rank == 0:`"


@pytest.mark.slow
def test_a_late_rank_saves_and_a_save_inside_if_rank_0_fails_fast(tmp_path: Path) -> None:
    # short waits, each a margin above the one it must outlast: the warning after 1 s, rank 0 3 s late, the bound 6 s
    env = {"DIST_RESUME_COLLECTIVE_WARN": "1", "DIST_RESUME_COLLECTIVE_TIMEOUT": "6"}
    start = time.monotonic()
    out = run_torchrun([SCRIPT, str(tmp_path / "run"), "--late", "3"], nproc=2, cwd=tmp_path, env=env, timeout=120)
    took = time.monotonic() - start
    text = out.stdout + out.stderr
    # rank 0 evaluated for 3 s before a correct save: rank 1 warned and waited, and both saved
    assert "rank 0: saved step 2" in text and "rank 1: saved step 2" in text, text[-3000:]
    assert "rank 1 has waited" in text and "CheckpointManager.save(step=2) for ranks [0]" in text, text[-3000:]
    # the save inside `if rank == 0:` at step 3: warned about within seconds, then UsageError at the bound
    assert "rank 0 has waited" in text and "CheckpointManager.save(step=3) for ranks [1]" in text, text[-3000:]
    assert "UsageError: rank 0 waited" in text and FIX in text, text[-3000:]
    assert out.returncode != 0
    assert took < 90, f"the job took {took:.0f} s to stop"
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000002.pt"]


@pytest.mark.slow
def test_a_save_inside_if_rank_0_is_named_within_a_minute_by_default(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DIST_RESUME_COLLECTIVE")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    proc = subprocess.Popen(
        [*cmd, SCRIPT, str(tmp_path / "run"), "--alone-at", "1"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    start = time.monotonic()
    try:
        assert proc.stderr is not None
        os.set_blocking(proc.stderr.fileno(), False)
        while time.monotonic() - start < 75 and not any("rank 0 has waited" in line for line in lines):
            line = proc.stderr.readline()
            if line:
                lines.append(line)
            elif proc.poll() is not None:
                break
            else:
                time.sleep(0.1)
        took = time.monotonic() - start
        assert proc.poll() is None, "".join(lines)[-3000:]  # no error: the default bound is the group's timeout
    finally:
        kill_tree(proc.pid)
        proc.wait(timeout=30)
    warning = next((line for line in lines if "rank 0 has waited" in line), None)
    assert warning is not None, "".join(lines)[-3000:]
    assert "CheckpointManager.save(step=1) for ranks [1]" in warning and FIX in warning
    assert took < 60, f"named after {took:.0f} s"


# --- rank functions (module level, so forkserver children import them) ---


def _manager(folder: str, **kwargs: object) -> dr.CheckpointManager:
    return dr.CheckpointManager(folder, model=torch.nn.Linear(2, 2), **kwargs)  # type: ignore[arg-type]


def ranks_in_different_calls(rank: int, world_size: int, folder: str) -> str:
    mgr = _manager(folder)
    try:
        if rank == 0:
            mgr.save(1)
        else:
            mgr.resume()
    except dr.errors.UsageError as err:
        return str(err)
    return "no error"


def rank_0_alone(rank: int, world_size: int, folder: str, bound: float | None) -> tuple[str, float]:
    mgr = _manager(folder, collective_timeout=bound)
    start = time.monotonic()
    try:
        if rank == 0:
            mgr.save(1)
    except dr.errors.UsageError as err:
        return str(err), time.monotonic() - start
    dist.barrier() if rank == 0 else None
    return "no error", time.monotonic() - start


def test_ranks_in_different_calls_are_told_at_once(tmp_path: Path) -> None:
    results = run_ranks(ranks_in_different_calls, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"),))
    # the second to arrive sees the first one's call, and tells the first
    for message in results:
        assert "called CheckpointManager." in message and "while another rank called CheckpointManager." in message
        assert "every rank must make the same dist_resume calls in the same order" in message


@pytest.mark.parametrize("bound", [None, 2.0], ids=["the group's timeout", "collective_timeout="])
def test_the_bound_is_the_groups_timeout_or_the_managers(tmp_path: Path, bound: float | None) -> None:
    results = run_ranks(
        rank_0_alone, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"), bound), pg_timeout=4, deadline=40
    )
    message, took = results[0]
    assert "rank 0 waited" in message and "ranks [1]" in message and FIX in message, message
    expected = 4.0 if bound is None else bound
    assert expected <= took < expected + 4, took
    assert results[1][0] == "no error"


def public_call_on_rank_0_alone(rank: int, world_size: int, folder: str, call: str) -> str:
    model = torch.nn.Linear(2, 2)
    path = os.path.join(folder, "one.pt")
    if call == "resume":  # the file must exist for the call to reach its check-in
        dr.save_checkpoint(path, model=model, step=1)
    if rank != 0:
        return "not called"
    try:
        if call == "resume":
            dr.resume(path, model=model)
        elif call == "save_checkpoint":
            dr.save_checkpoint(path, model=model, step=2)
        else:
            dr.save_checkpoint_async(path, model=model, step=2).wait()
    except dr.errors.UsageError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("call", ["resume", "save_checkpoint", "save_checkpoint_async"])
def test_the_public_collective_functions_check_in_too(tmp_path: Path, call: str) -> None:
    env = {"DIST_RESUME_COLLECTIVE_TIMEOUT": "2"}
    results = run_ranks(
        public_call_on_rank_0_alone, 2, tmp_path=tmp_path, args=(str(tmp_path), call), env=env, deadline=40
    )
    assert re.search(rf"rank 0 waited \d+ s in dist_resume\.{call}\(", results[0]) and FIX in results[0], results[0]
