"""Foreign folders under the real torchrun: 2 gloo ranks resume an HF Trainer and a DCP folder into DDP.

One launch runs every check (each launch costs seconds): both folders, each read by every rank and
read by rank 0 then broadcast. Timeouts nest: the process group's 60 s < the launch's < pytest's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.dist.harness import REPO_ROOT, run_torchrun
from tests.interop.conftest import Saved

pytestmark = pytest.mark.dist

WORKER = str(Path(__file__).with_name("sources_worker.py"))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hf_and_dcp_folders_resume_into_ddp_on_two_ranks(hf_checkpoint: Saved, dcp_dsd: Saved, tmp_path: Path) -> None:
    assert hf_checkpoint.optimizer is not None and dcp_dsd.optimizer is not None
    expected = {
        "hf": {"model": hf_checkpoint.model, "state": hf_checkpoint.optimizer["state"]},
        "dcp": {"model": dcp_dsd.model, "state": dcp_dsd.optimizer["state"]},
    }
    torch.save(expected, tmp_path / "expected.pt")
    proc = run_torchrun(
        [WORKER, str(hf_checkpoint.path), str(dcp_dsd.path), str(tmp_path / "expected.pt")],
        nproc=2,
        cwd=REPO_ROOT,
        timeout=150,
    )
    assert proc.returncode == 0, f"torchrun exited with {proc.returncode}\n{(proc.stdout + proc.stderr)[-5000:]}"
    results = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout[-3000:]
    for r in results:
        assert r["world_size"] == 2
        assert set(r["checks"]) == {"hf", "hf-broadcast", "dcp", "dcp-broadcast"}
        failed = {name: problem for name, problem in r["checks"].items() if problem is not None}
        assert not failed, f"rank {r['rank']}: {failed}"
