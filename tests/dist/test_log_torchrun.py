"""A DDP script as users write it, with no logging set up, under torchrun with 2 ranks: the library's resume and save
lines reach stderr once each, from global rank 0 only (tests/test_log.py checks one process in detail)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.dist.harness import run_torchrun

pytestmark = pytest.mark.dist

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import dist_resume as dr

dr.init_distributed()
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
assert mgr.resume() is None
mgr.save(1, epoch=0)
mgr.save_async(2, epoch=1).wait()
assert mgr.resume().step == 2
assert dr.resume(sys.argv[1], model=model, optimizer=opt).step == 2
mgr.close()
print(f"rank {rank} done", flush=True)
dr.destroy_distributed()
"""


@pytest.mark.slow
def test_a_script_without_logging_under_torchrun_says_each_resume_and_save_once(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    folder = tmp_path / "run"
    env = {k: "" for k in os.environ if k.startswith("DIST_RESUME")}  # blank: the default verbosity
    out = run_torchrun([str(script), str(folder)], nproc=2, cwd=tmp_path, env=env, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 0 done" in out.stdout and "rank 1 done" in out.stdout
    said = ("no checkpoint in ", "saved ", "resumed from ")  # the library's lines: the message alone
    lines = [line for line in out.stderr.splitlines() if line.startswith(said)]
    assert lines[0] == f"no checkpoint in {folder}: starting fresh", lines
    assert [line.split(" (")[0] for line in lines[1:3]] == [
        f"saved {folder / 'ckpt_00000001.pt'}",
        f"saved {folder / 'ckpt_00000002.pt'}",
    ], lines
    assert "(step 1, epoch 0, " in lines[1] and "(step 2, epoch 1, " in lines[2] and "in the background" in lines[2]
    resumed = f"resumed from {folder / 'ckpt_00000002.pt'} at step 2 (epoch 1) in "
    assert [line.startswith(resumed) for line in lines[3:]] == [True, True], lines  # mgr.resume(), dr.resume()
    assert len(lines) == 5, lines  # rank 1 said nothing
    assert "process group" not in out.stderr and "rotated" not in out.stderr
