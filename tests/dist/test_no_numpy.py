"""dist_resume's collectives work on a torch-only install (torch's object collectives need numpy)."""

from __future__ import annotations

import os

import pytest

from tests.dist.harness import run_torchrun

pytestmark = pytest.mark.dist


@pytest.mark.e2e
@pytest.mark.timeout(200)
def test_collectives_work_without_numpy(tmp_path, repo_root):
    worker = os.path.join(os.path.dirname(__file__), "no_numpy_worker.py")
    proc = run_torchrun([worker, str(tmp_path / "ckpts")], nproc=2, cwd=tmp_path, timeout=160)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-6000:]}"
    assert sorted(line for line in proc.stdout.splitlines() if line.startswith("OK")) == [
        "OK rank=0 steps=2,2",
        "OK rank=1 steps=2,2",
    ]
