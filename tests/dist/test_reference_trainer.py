"""torchvision's reference trainer with dist_resume, as a user runs it: tests/user_loops/torchvision_train_resumable.py
under torchrun (gloo), killed mid-run (SIGKILL to the whole process tree, FACTS 37) and relaunched unchanged, its
checkpoints compared bitwise with an uninterrupted run's (model, optimizer, scheduler, EMA, RNG streams, data
position) through the public API: ``dist_resume.testing.check_resume``, the engine of ``dist-resume check``.

What the script holds that made this fail before 0.5: DataLoader workers (not persistent) that draw random
augmentation from torch's, Python's and NumPy's global streams and a ``collate_fn`` that draws mixup/cutmix; a
per-epoch scheduler stepped after the batch loop with saves that land on an epoch's last batch (``--save-every 3``:
6 steps an epoch at 4 ranks); BatchNorm and SGD momentum at 4 ranks, where DDP's first step after a resume reduced in
another bucket layout (FACTS 42). Each case costs a reference run and two launches (35–50 s here): one at 4 ranks
with a snapshot every step (the relaunch resumes from shared memory when a snapshot is newer than the folder's
newest) and one at 2 ranks; 8 ranks, and the other combinations, with ``-m slow``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_resume.testing import check_resume
from tests.dist.harness import REPO_ROOT

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/user_loops/torchvision_train_resumable.py")


def _check(tmp_path: Path, nproc: int, *flags: str, interrupts: int = 1, seed: int = 3) -> str:
    """check_resume of the script at ``nproc`` ranks; asserts exact; returns what the relaunches logged."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", SCRIPT]
    (tmp_path / "shm").mkdir()
    env = {"OMP_NUM_THREADS": "1", "DIST_RESUME_SHM_DIR": str(tmp_path / "shm")}
    result = check_resume(
        [*command, "--output-dir", "{dir}", *flags], interrupts=interrupts, seed=seed, timeout=240, env=env, keep=True
    )
    assert result.exact, result.report()
    assert result.interrupts == interrupts
    assert set(result.extra_differs) <= {"['args']['start_epoch']"}, result.extra_differs  # the script's own
    return "".join(launch.stderr.read_text() + launch.stdout.read_text() for launch in result.launches[1:])


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_at_4_ranks_with_a_snapshot_every_step_the_relaunch_resumes_bitwise(tmp_path):
    logged = _check(tmp_path, 4, "--workers=1", "--snapshot", "--save-every=3")
    # from shared memory when a snapshot newer than the folder's newest was committed before the kill (the moment is
    # drawn: a kill during the step after an epoch-end save, whose extra retired that step's snapshot, finds none)
    assert "resumed from" in logged, logged[-3000:]


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_at_2_ranks_with_two_workers_each_the_relaunch_resumes_bitwise(tmp_path):
    _check(tmp_path, 2, "--workers=2", "--save-every=2", seed=1)  # resumed mid-epoch: the workers draw again


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("nproc", "flags"),
    [
        (8, ("--workers=1", "--train-size=256", "--save-every=2")),  # 4 steps an epoch
        (4, ("--workers=2", "--save-every=5")),
        (2, ("--workers=2", "--snapshot", "--save-every=6")),
    ],
    ids=["8 ranks", "4 ranks, saves only", "2 ranks, snapshots"],
)
def test_killed_twice_the_run_ends_bitwise_equal(tmp_path, nproc, flags):
    _check(tmp_path, nproc, *flags, interrupts=2, seed=nproc)
