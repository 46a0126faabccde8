"""FSDP2 snapshots in host memory, as a user reaches them: tests/dist/memory_script.py ``--fsdp`` (snapshot every step,
save every 5) under torchrun with 2 ranks, rank 1 SIGKILLed between saves and both workers restarted by
``--max-restarts=1``: every rank resumes from its own shards in memory, redoes no step and ends bitwise equal to a run
that never failed; the folder's sharded checkpoints written from the snapshots hold the state of their step, and a
clean end leaves nothing in shared memory (``DIST_RESUME_SHM_DIR`` points the snapshots into the test's folder)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_resume as dr
from tests.dist import memory_fsdp_workers as MW
from tests.dist.harness import REPO_ROOT, run_ranks, run_torchrun
from tests.helpers import nested_equal

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/dist/memory_script.py")


def _steps(path: Path) -> list[int]:
    return [int(line.split()[1]) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_a_killed_fsdp2_worker_resumes_from_its_own_shards_in_memory_bitwise(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"DIST_RESUME_SHM_DIR": str(shm)}
    ref = run_torchrun([SCRIPT, "ref", "--fsdp", "--dump", "ref.pt"], nproc=2, cwd=tmp_path, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert list(shm.iterdir()) == [], list(shm.rglob("*"))

    # rank 1 SIGKILLed after step 7: torchrun stops rank 0 (SIGTERM: its peer is gone, so nothing is written at
    # exit) and restarts both, which resume from memory at 7; after step 9 torchrun gets SIGTERM (a preemption
    # notice) and stops both workers with SIGTERM: together they write the snapshot of step 9 into the folder
    run = run_torchrun(
        [SCRIPT, "run", "--fsdp", "--kill-rank1-at", "7", "--preempt-at", "9"],
        nproc=2,
        cwd=tmp_path,
        env=env,
        extra_torchrun_args=["--max-restarts=1"],
    )
    out = run.stdout + run.stderr
    assert run.returncode != 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} generation 1: resumed (7, 'memory')" in out, out[-3000:]
    folder = tmp_path / "run"
    assert {p.name for p in folder.glob("ckpt_*")} == {"ckpt_00000005.dcp", "ckpt_00000009.dcp"}, out[-3000:]
    assert dr.load_checkpoint(folder / "ckpt_00000009.dcp")["step"] == 9
    assert list(shm.rglob("shards-*.json")), "the snapshots stay in memory for the restart"

    again = run_torchrun([SCRIPT, "run", "--fsdp", "--dump", "run.pt"], nproc=2, cwd=tmp_path, env=env)
    out = again.stdout + again.stderr
    assert again.returncode == 0, out[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} generation 0: resumed (9, 'memory')" in out, out[-3000:]
        mine, theirs = torch.load(tmp_path / f"run.pt.{rank}"), torch.load(tmp_path / f"ref.pt.{rank}")
        assert nested_equal(mine, theirs), f"rank {rank}'s shards are not bitwise equal"
        assert _steps(tmp_path / f"run.steps_{rank}") == list(range(1, 13))  # no step run twice
    assert {p.name for p in folder.glob("ckpt_*")} == {"ckpt_00000010.dcp", "ckpt_00000012.dcp"}
    assert list(shm.iterdir()) == [], list(shm.rglob("*"))

    # the folder written by close() from the snapshots of step 12 holds the run's final weights, whole
    saved = dr.load_checkpoint(folder / "ckpt_00000012.dcp")
    full = [torch.load(tmp_path / f"ref.pt.{rank}")["model"] for rank in (0, 1)]
    for key, value in saved["model"].items():
        assert torch.equal(value, torch.cat([full[0][key], full[1][key]])), key
    assert saved["step"] == 12
    # save(10) wrote its folder from the snapshots in the background, in the interrupted run as in the reference
    tenth = [dr.load_checkpoint(tmp_path / name / "ckpt_00000010.dcp") for name in ("run", "ref")]
    assert tenth[0]["step"] == 10 and nested_equal(tenth[0]["model"], tenth[1]["model"])


def test_a_snapshot_that_fails_on_one_rank_commits_nothing_and_the_previous_one_resumes(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"DIST_RESUME_SHM_DIR": str(shm)}
    results = run_ranks(MW.failing_snapshot, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"),), env=env)
    for result in results:
        assert result["error"] is not None and "rank 1 cannot lay out its shards" in result["error"], result
        assert result["error"].startswith("CheckpointWriteError") and "rank 1" in result["error"], result
        assert result["newest"] == 1 and result["resumed"] == (1, "memory") and result["differ"] == [], result


def test_snapshots_of_another_world_size_are_not_used_and_are_kept(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"DIST_RESUME_SHM_DIR": str(shm)}
    folder = str(tmp_path / "run")
    left = run_ranks(MW.left_at_two, 2, tmp_path=tmp_path, args=(folder,), env=env)
    assert all("full_state=True" in r["refused"] and "sharded checkpoint" in r["refused"] for r in left), left
    # rank 1 changed its shard between snapshot(2) and save(2): both ranks saved the live state, retired step 2
    assert [r["newest after save(2)"] for r in left] == [None, None], left
    (result,) = run_ranks(MW.resumed_at_one, 1, tmp_path=tmp_path, args=(folder,), env=env)
    assert result["resumed"] == (2, "folder") and result["rank 1's rows zero"], result
    assert result["kept"] == sorted(f"shards-0000{r}.{s}.json" for r in (0, 1) for s in "ab"), result


def test_the_write_at_an_unplanned_end_takes_the_newest_step_every_rank_holds(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"DIST_RESUME_SHM_DIR": str(shm)}
    results = run_ranks(MW.uneven_commits, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"),), env=env)
    assert results == [["ckpt_00000001.dcp"], ["ckpt_00000001.dcp"]], results
