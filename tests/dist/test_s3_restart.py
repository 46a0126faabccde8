"""A torchrun ``--max-restarts`` restart resumes from a bucket at once: the first generation's rank 0 dies holding the
folder's write lease (torchrun's SIGTERM runs no exit code), and the next generation's rank 0 takes it over as an
earlier generation of its own job, instead of waiting a minute for it to expire. One torchrun launch, against the test
session's S3 server (tests/conftest.py); the worker is tests/dist/s3_restart_worker.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_resume._manager.lease import LEASE_NAME, WAIT_ENV
from tests.dist import s3_restart_worker as W
from tests.dist.harness import run_torchrun

pytest.importorskip("s3fs")
fsspec = pytest.importorskip("fsspec")

pytestmark = pytest.mark.dist

WORKER = str(Path(W.__file__))


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_max_restarts_restart_takes_the_dead_generations_lease_and_resumes_from_the_bucket(
    s3_bucket: str, tmp_path: Path
) -> None:
    url = f"{s3_bucket}/run"
    proc = run_torchrun(
        [WORKER, url],
        nproc=2,
        cwd=tmp_path,
        env={WAIT_ENV: "0"},  # a lease not taken over refuses at once, never expires into a pass
        timeout=150,
        extra_torchrun_args=["--max-restarts=1"],
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    results = {
        (r["generation"], r["rank"]): r
        for r in (json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    }
    assert sorted(results) == [(0, 0), (0, 1), (1, 0), (1, 1)], output[-6000:]
    assert "exitcode: -9" in output or "Signals.SIGKILL" in output, output[-3000:]  # rank 1 of the first generation
    first, again = results[0, 0], results[1, 0]
    assert first["resumed"] is None and "saved" not in first  # the first generation stopped at step 2
    assert again["pid"] != first["pid"]
    # the new rank 0 took the lease the dead one left, naming it and why (before its resume returned)
    took = [line for line in output.splitlines() if "took over the write lease" in line]
    assert len(took) == 1 and f"pid {first['pid']}" in took[0] and "torchrun restarted its job" in took[0], took
    assert "generation 0, now 1" in took[0]
    for rank in (0, 1):
        r = results[1, rank]
        assert r["resumed"] == W.KILL_AFTER and r["saved"] == ["ckpt_00000003.pt", "ckpt_00000004.pt"]
        assert r["weight"] == results[1, 0]["weight"]
    print(f"first generation's kill to the restarted rank 0's resume: {again['resumed_at'] - first['killed_at']:.1f} s")
    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url))
    assert names == ["ckpt_00000003.pt", "ckpt_00000004.pt"]  # the restarted job closed its manager: no lease
    assert LEASE_NAME not in names
