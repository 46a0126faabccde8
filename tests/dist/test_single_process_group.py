"""init_distributed under `torchrun --nproc_per_node=1`: a real process group of one (one launch, several checks)."""

from __future__ import annotations

import json
import os

import pytest

from tests.dist.harness import run_torchrun

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(__file__), "single_worker.py")


@pytest.mark.timeout(150)
def test_torchrun_with_one_process_gets_a_group_ddp_and_a_clean_teardown(tmp_path):
    proc = run_torchrun([WORKER, str(tmp_path / "one.pt")], nproc=1, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    report = json.loads(line[len("RESULT ") :])
    assert report == {
        "world_size": 1,
        "is_distributed": False,  # no other rank to agree with...
        "initialized": True,  # ...yet a group exists, so DDP(model) works
        "group_size": 1,
        "backend": "gloo",
        "device": "cpu",
        "resumed_step": 1,
        "resumed_weights": True,
        "saved_keys_unprefixed": True,
        "initialized_after_destroy": False,
    }
