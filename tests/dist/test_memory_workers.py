"""Snapshots with DataLoader workers alive (FACTS 43), as a user reaches them: tests/dist/memory_workers_script.py under
torchrun with 2 ranks, a loader with persistent workers and one whose workers live an epoch, snapshots every step and
no save, then a preemption notice (SIGTERM to torchrun, which sends it to every worker's process group, the
DataLoader workers included) in the third epoch. One launch checks both: the workers of the second epoch, forked after
snapshots, write nothing into the folder; at the notice, rank 0's handler writes the newest snapshot
into the folder whatever the workers and the DataLoader's SIGCHLD handler do, with no failure said."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.dist.harness import REPO_ROOT, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/dist/memory_workers_script.py")


def test_workers_write_nothing_and_a_notice_with_workers_alive_writes_the_newest_snapshot(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    out = run_torchrun(
        [SCRIPT, "run", "--preempt-at", "19"], nproc=2, cwd=tmp_path, env={"DIST_RESUME_SHM_DIR": str(shm)}
    )
    said = out.stdout + out.stderr
    assert out.returncode != 0, said[-3000:]  # ended by the notice
    assert "rank 0: resumed None" in said and "rank 1: resumed None" in said, said[-3000:]
    # the second epoch's workers, forked after snapshot 8 and ended after snapshot 16, wrote nothing
    assert "before the notice, at step 19 (workers alive): []" in said, said[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000019.pt"], said[-3000:]
    assert torch.load(tmp_path / "run" / "ckpt_00000019.pt", weights_only=True)["meta"]["step"] == 19
    for line in ("failed", "DataLoader worker (pid", "RuntimeError"):  # torchrun itself prints its SignalException
        assert line not in said, said[-3000:]
    assert list(shm.rglob("state.*.json")), "the snapshots stay in shared memory for the restart"
