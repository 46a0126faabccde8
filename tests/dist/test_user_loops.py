"""Exact resume as users write their loops: tests/user_loops/train.py under torchrun with 2 ranks (gloo), killed (the
whole process tree, FACTS 37) mid-epoch after a checkpoint newer than its launch exists, relaunched, and compared
bitwise with an uninterrupted run (model, optimizer, scheduler, RNG streams, data position), through the public API.

One kill-and-relaunch case costs a reference run and three launches (about 25 s of both cores here), so every case,
killed twice, the world-size change and the warning for a plain prefetching loader run with ``-m slow``; CI's
end-to-end proof of a user's loop under torchrun is torchvision's reference trainer (tests/dist/test_reference_trainer.py:
workers with random augmentation, at 2 and 4 ranks). The same loops in one process,
stopped at chosen steps (persistent workers in an epoch's last batches among them), are tests/test_exact_loaders.py's.
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_resume.testing import check_resume
from tests.dist.harness import REPO_ROOT, run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = str(REPO_ROOT / "tests/user_loops/train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT, "{dir}"]

CASES = {
    "no generator, the DDP tutorial's peek and set_epoch": ["--peek"],
    "StatefulDataLoader, prefetching workers, augmentation in them": [
        "--loader=stateful",
        "--workers=2",
        "--prefetch=3",
        "--augment",
    ],
    "persistent workers, saves in the last batches of an epoch": ["--workers=2", "--persistent", "--save-tail=2"],
    "no generator, num_workers=0": [],
    "persistent workers, the tutorial's peek": ["--workers=2", "--persistent", "--peek"],
    "StatefulDataLoader, the tutorial's peek, saves at an epoch's end": [
        "--loader=stateful",
        "--workers=2",
        "--peek",
        "--save-tail=1",
    ],
    "batch_sampler=, no generator, the tutorial's peek": ["--batch-sampler", "--peek"],
    "StatefulDataLoader(batch_sampler=), prefetching workers, augmentation": [
        "--loader=stateful",
        "--batch-sampler",
        "--workers=2",
        "--augment",
    ],
    "StatefulDataLoader, persistent workers, augmentation": [
        "--loader=stateful",
        "--workers=2",
        "--persistent",
        "--augment",
    ],
}


def _check(flags: list[str], interrupts: int) -> None:
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    result = check_resume([*TORCHRUN, *flags], interrupts=interrupts, seed=len(flags), timeout=200, env=env)
    assert result.exact, result.report()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES)
def test_every_case_killed_twice_ends_bitwise_equal(case):
    _check(CASES[case], interrupts=2)


def _one_process(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """The script in one process (no torchrun), as ``python train.py DIR ...``; it must succeed."""
    args = [sys.executable, SCRIPT, str(folder), *flags, "--epochs=1", "--step-time=0"]
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


@pytest.mark.slow
def test_a_plain_dataloader_whose_workers_prefetch_is_warned_with_the_fix(tmp_path):
    """One process is enough to show it: the warning comes once, at the first save, naming the exact ways (the
    default suite checks the same warning in-process: tests/test_exact_loaders.py)."""
    out = _one_process(tmp_path, "--workers=2")
    lines = [line for line in out.stderr.splitlines() if "keeps no reference to its iterator" in line]
    assert len(lines) == 1, out.stderr[-3000:]
    for fix in ("persistent_workers=True", "StatefulDataLoader", "dataloader=sampler.state_dict(consumed="):
        assert fix in lines[0]
    assert "Traceback" not in out.stderr


def _samples(folder: Path, rank: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / f"samples_{rank}").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stateful_dataloader_resumed_by_one_process_sees_every_sample_of_the_epoch_once(tmp_path):
    """2 ranks with prefetching workers stopped mid-epoch (as --stop would: the process tree killed right after the
    first checkpoint), resumed by one process: the rest of the epoch is split over the ranks present now."""
    flags = ["--loader=stateful", "--workers=2", "--prefetch=3", "--log-samples"]
    folder = tmp_path / "run"
    first = run_torchrun([SCRIPT, str(folder), *flags, "--epochs=1", "--save-tail=0"], nproc=2, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    for path in folder.glob("ckpt_*.pt"):  # keep the first checkpoint only: the run "stopped" at step 3
        if path.name != "ckpt_00000003.pt":
            path.unlink()
    saved = torch.load(folder / "ckpt_00000003.pt", weights_only=True)
    assert (saved["sampler"]["epoch"], saved["sampler"]["consumed"]) == (0, 24)
    assert [entry["rank"] for entry in saved["sampler"]["loader"]] == [0, 1]
    before = [i for rank in (0, 1) for r in _samples(folder, rank) if r["step"] <= 3 for i in r["indices"]]
    (folder / "samples_0").unlink()
    second = _one_process(folder, *flags)
    assert "holds RNG state for 2 rank(s) but the job has 1" in second.stderr  # the policy, said
    after = [i for r in _samples(folder, 0) for i in r["indices"]]
    counts = collections.Counter(before + after)
    assert sorted(counts) == list(range(64)) and set(counts.values()) == {1}, "every sample of epoch 0 exactly once"
