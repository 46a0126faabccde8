"""Snapshots in host memory, as a user reaches them: tests/dist/memory_script.py (snapshot every step, save every 5)
under torchrun with 2 ranks, a worker SIGKILLed between saves and restarted by ``--max-restarts=1``, then the whole
job dying at once and relaunched, compared bitwise with a run that never failed; no step is run twice, and a clean
end leaves nothing in shared memory (``DIST_RESUME_SHM_DIR`` points the snapshots into the test's folder)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.dist.harness import REPO_ROOT, run_torchrun, run_two_nodes
from tests.helpers import nested_equal

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/dist/memory_script.py")


def _steps(path: Path) -> list[tuple[int, int]]:
    return [(int(g), int(s)) for g, s in (line.split() for line in path.read_text().splitlines())]


@pytest.mark.e2e
def test_a_killed_worker_and_a_dead_job_resume_from_memory_bitwise_and_redo_no_step(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    env = {"DIST_RESUME_SHM_DIR": str(shm)}
    ref = run_torchrun([SCRIPT, "ref", "--dump", "ref.pt"], nproc=2, cwd=tmp_path, env=env)
    assert ref.returncode == 0, ref.stderr[-3000:]

    # rank 1 SIGKILLed right after snapshot(7), between the saves of steps 5 and 10: torchrun restarts both workers
    # (rank 0 gets SIGTERM: its handler ends the commit of step 7 under way in the background, then copies it), the
    # restart resumes from memory at 7; at step 9 every rank dies at once, restarts spent
    died = run_torchrun(
        [SCRIPT, "run", "--kill-rank1-at", "7", "--all-die-at", "9", "--background-commits"],
        nproc=2,
        cwd=tmp_path,
        env=env,
        extra_torchrun_args=["--max-restarts=1"],
    )
    assert died.returncode != 0
    out = died.stdout + died.stderr
    assert "rank 0 generation 1: resumed (7, 'memory')" in out and "rank 1 generation 1: resumed (7, 'memory')" in out
    # rank 0's SIGTERM handler copied the newest snapshot into the folder; os._exit at 9 copied nothing
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000005.pt", "ckpt_00000007.pt"]

    # the whole job relaunched: step 9 came from memory only
    again = run_torchrun([SCRIPT, "run", "--dump", "run.pt"], nproc=2, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "rank 0 generation 0: resumed (9, 'memory')" in again.stdout + again.stderr
    assert nested_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt")), "not bitwise equal"
    for rank in (0, 1):  # every step run exactly once, across the three generations
        steps = _steps(tmp_path / f"run.steps_{rank}")
        assert [s for _, s in steps] == list(range(1, 13)), steps
    # close() copied the newest snapshot (12) into the folder and freed the shared memory
    assert {"ckpt_00000010.pt", "ckpt_00000012.pt"} <= {p.name for p in (tmp_path / "run").glob("ckpt_*")}
    assert list(shm.iterdir()) == [], list(shm.rglob("*"))


@pytest.mark.slow
def test_a_node_whose_memory_was_wiped_gets_the_snapshot_from_rank_0s_node(tmp_path: Path) -> None:
    """Two torchrun agents (two nodes of 2 ranks), each with its own shared memory; every rank dies after step 9; the
    memory of the node without rank 0 is wiped (a machine replaced); the relaunch resumes from rank 0's node's
    snapshot, sent over the process group, and ends bitwise equal to the same job resumed from the folder's
    checkpoint of step 9. (Against a run that never failed, 4 ranks end with the same weights but Adam moments that
    differ in their last bits: a DDP model wrapped anew mid-run differs too, with no resume; see docs/exact-resume.md.)
    """
    shm = [tmp_path / "shm0", tmp_path / "shm1"]
    nodes = ({"DIST_RESUME_SHM_DIR": str(shm[0])}, {"DIST_RESUME_SHM_DIR": str(shm[1])})

    def wipe(*folders: Path) -> None:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()

    wipe(*shm)
    run_two_nodes([SCRIPT, "ref", "--all-die-at", "9", "--close-before-dying"], cwd=tmp_path, node_env=nodes)
    wipe(*shm)  # the reference resumes from the folder's checkpoint of step 9
    ref = run_two_nodes([SCRIPT, "ref", "--dump", "ref.pt"], cwd=tmp_path, node_env=nodes)
    said = "".join(o.stdout + o.stderr for o in ref)
    assert all(o.returncode == 0 for o in ref) and "resumed (9, 'folder')" in said, said[-3000:]

    died = run_two_nodes([SCRIPT, "run", "--all-die-at", "9"], cwd=tmp_path, node_env=nodes)
    said = "".join(o.stdout + o.stderr for o in died)
    rank0_memory = re.search(r"rank 0 generation 0: resumed None; memory (\S+)", said)
    assert rank0_memory is not None, said[-3000:]
    wipe(next(folder for folder in shm if str(folder) != rank0_memory.group(1)))
    again = run_two_nodes([SCRIPT, "run", "--dump", "run.pt"], cwd=tmp_path, node_env=nodes)
    out = "".join(o.stdout + o.stderr for o in again)
    assert all(o.returncode == 0 for o in again), out[-3000:]
    for rank in range(4):
        assert f"rank {rank} generation 0: resumed (9, 'memory')" in out, out[-3000:]
    assert nested_equal(torch.load(tmp_path / "run.pt"), torch.load(tmp_path / "ref.pt")), "not bitwise equal"
