"""Checkpoint folders on an object store, against a real S3-protocol server on 127.0.0.1 (moto's server mode, started
once per test session by the ``s3_endpoint`` fixture): a manager on ``s3://bucket/run`` saves and rotates, resumes in
fresh processes under torchrun with 2 ranks bitwise (and with ``broadcast_from_rank0``, and an FSDP2 sharded folder on
the bucket), survives a SIGKILL mid-upload (its relaunch takes the dead job's lease over) and a damaged newest object;
the CLI lists, inspects, compares and converts URLs. One torchrun launch does the multi-process part. The fast unit
tests of the same promises run on ``memory://`` (tests/test_store.py, tests/test_remote.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._core.location import RemotePath
from dist_resume._format.records import read_records
from dist_resume._manager.lease import LEASE_NAME
from dist_resume._manager.lease_object import Lease
from dist_resume.cli import main as cli_main
from tests.dist.harness import run_torchrun

pytest.importorskip("s3fs")
fsspec = pytest.importorskip("fsspec")

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKER = str(REPO_ROOT / "tests" / "dist" / "s3_worker.py")

# a script that ends without close(): normally, with a save_async still uploading, or by an exception after resume
_ENDS_WITHOUT_CLOSE = textwrap.dedent("""
    import sys, torch, dist_resume as dr
    url, how = sys.argv[1], sys.argv[2]
    mgr = dr.CheckpointManager(url, model=torch.nn.Linear(512, 512))
    mgr.resume()
    if how == "raise":
        raise RuntimeError("training crashed after resume")
    mgr.save(1)
    mgr.save_async(2)
""")


def _net(seed: int = 0, width: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def _step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(8, 16, generator=g)).pow(2).sum().backward()
    opt.step()


def _flip_tensor_byte(fs: Any, url: str, tmp_path: Path) -> None:
    """Flip one byte inside the largest tensor record of the object at ``url``."""
    local = tmp_path / "flip.pt"
    local.write_bytes(fs.cat_file(url))
    _, records = read_records(local)
    record = max((r for r in records if "/data/" in r.name), key=lambda r: r.file_size)
    data = bytearray(local.read_bytes())
    data[record.data_offset + record.file_size // 2] ^= 0xFF
    fs.pipe_file(url, bytes(data))


def test_the_cli_lists_inspects_compares_and_converts_urls(
    s3_bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{s3_bucket}/run"
    model = _net()
    with dr.CheckpointManager(url, model=model) as mgr:
        first = mgr.save(10)
        mgr.save(20)
    local = tmp_path / "local.pt"
    assert cli_main(["convert", str(first), str(local), "--to", "single", "-q"]) == 0
    assert cli_main(["list", url, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in listed["checkpoints"]] == ["ckpt_00000010.pt", "ckpt_00000020.pt"]
    assert listed["pick"] == "ckpt_00000020.pt"
    assert cli_main(["inspect", str(first), "--json"]) == 0
    inspected = json.loads(capsys.readouterr().out)
    assert inspected["meta"]["step"] == 10 and inspected["layout"] == "dist_resume"
    assert cli_main(["verify", str(first), str(local), "-q"]) == 0  # the same weights, one side local
    assert cli_main(["convert", str(first), f"{url}/ddp.pt", "--to", "ddp", "--json"]) == 0
    converted = json.loads(capsys.readouterr().out)
    assert converted["dst"] == f"{url}/ddp.pt" and converted["prefix_after"] == "module."
    assert cli_main(["verify", str(first), f"{url}/ddp.pt", "-q"]) == 0
    assert cli_main(["list", "s3:/bucket/run"]) == 2  # a collapsed URL is refused, never listed as a local folder
    assert "collapsed" in capsys.readouterr().err


def _uploads(fs: Any, url: str) -> list[str]:
    """The keys of the unfinished multipart uploads directly under ``url``."""
    bucket, _, prefix = url[len("s3://") :].partition("/")
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=f"{prefix}/")
    return [u["Key"].rsplit("/", 1)[1] for u in listed.get("Uploads", [])]


def _names(fs: Any, url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(url, refresh=True))


@pytest.mark.e2e
@pytest.mark.dist
@pytest.mark.timeout(220)
def test_a_job_on_a_bucket_saves_rotates_resumes_under_torchrun_and_survives_a_kill_and_damage(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """One job's life on ``s3://bucket/run``: a first run saves and rotates; a relaunch under torchrun (2 fresh
    processes) resumes bitwise, saves, resumes with broadcast_from_rank0, saves and resumes an FSDP2 sharded folder,
    and dies by SIGKILL mid-upload; what is left resumes, a relaunch on this host takes the dead rank's lease over at
    once (tests/test_lease.py: the wait, the refusal of a live job), and a damaged newest object is skipped for the
    previous one."""
    monkeypatch.chdir(tmp_path)  # anything taken for a local path would appear here
    url, fs = f"{s3_bucket}/ddp", fsspec.filesystem("s3")
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with dr.CheckpointManager(url, model=model, optimizer=opt, keep_last=2) as mgr:
        assert mgr.resume() is None  # a first run: the prefix is empty
        assert isinstance(mgr.lock_path, RemotePath) and fs.exists(str(mgr.lock_path))
        for step in (5, 6, 7):
            _step(model, opt, step)
            path = mgr.save(step)
            assert isinstance(path, RemotePath) and str(path) == f"{url}/ckpt_{step:08d}.pt"
        assert [p.name for p in mgr.checkpoints()] == ["ckpt_00000006.pt", "ckpt_00000007.pt"]
        assert mgr.latest() == path
    assert _names(fs, url) == ["ckpt_00000006.pt", "ckpt_00000007.pt"]  # rotated; the lease released
    assert list(tmp_path.iterdir()) == []  # nothing reached the local disk, no folder named "s3:"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ref.pt")

    proc = run_torchrun([WORKER, s3_bucket, str(tmp_path / "ref.pt")], nproc=2, cwd=tmp_path, timeout=180)
    results = sorted(
        (json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
        key=lambda r: r["rank"],
    )
    assert proc.returncode != 0 and [r["rank"] for r in results] == [0, 1], proc.stderr[-6000:]
    assert "Signals.SIGKILL" in proc.stderr or "-9" in proc.stderr, proc.stderr[-3000:]  # rank 0, mid-upload
    for r in results:
        assert r["ddp_step"] == 7 and r["ddp_path"] == f"{url}/ckpt_00000007.pt"
        assert r["ddp_model"] == r["ddp_optim"] == r["broadcast_model"] == r["broadcast_optim"] == []
        assert r["ddp_saved"] == ["ckpt_00000006.pt", "ckpt_00000007.pt", "ckpt_00000008.pt"]
        assert r["fsdp_saved"] == f"{s3_bucket}/fsdp/ckpt_00000005.dcp" and r["fsdp_step"] == 5
    assert results[1]["broadcast_requests"] == 0 < results[0]["broadcast_requests"]  # rank 0 alone read the store
    assert results[0]["fsdp_model"] == results[0]["fsdp_optim"] == []
    shards = _names(fs, f"{s3_bucket}/fsdp/ckpt_00000005.dcp")
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json", "train_state.pt"]

    # the killed save: step 9 never appeared, its parts wait as an unfinished upload, the dead rank's lease stays
    assert _names(fs, url) == [LEASE_NAME, "ckpt_00000006.pt", "ckpt_00000007.pt", "ckpt_00000008.pt"]
    assert _uploads(fs, url) == ["ckpt_00000009.pt"]
    fresh = _net(seed=3)
    assert dr.resume(url, model=fresh).step == 8  # reading needs no lease
    lease = Lease.from_json(fs.cat_file(f"{url}/{LEASE_NAME}"))
    assert lease is not None and lease.job is not None and lease.expires > time.time()  # it names its torchrun job
    # a relaunch on this host takes the dead rank's lease over at once: its process is gone
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        with dr.CheckpointManager(url, model=model, optimizer=opt, keep_last=3) as mgr:
            good = {k: v.clone() for k, v in model.state_dict().items()}
            mgr.save(10)
            _step(model, opt, 10)
            newest = mgr.save(11)
    took = [r.getMessage() for r in caplog.records if "took over the write lease" in r.getMessage()]
    assert len(took) == 1 and f"pid {lease.pid}" in took[0] and "is gone from this host" in took[0], took
    assert _uploads(fs, url) == []  # the next save aborted the dead one's upload
    _flip_tensor_byte(fs, str(newest), tmp_path)  # its CRC-32 no longer matches
    again = _net(seed=4)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        result = dr.resume(url, model=again, optimizer=torch.optim.AdamW(again.parameters(), lr=0.01))
    assert result.step == 10 and all(torch.equal(again.state_dict()[k], v) for k, v in good.items())
    assert any("skipping checkpoint" in r.message and "ckpt_00000011.pt" in r.message for r in caplog.records)


@pytest.mark.timeout(120)
def test_a_process_that_ends_without_close_releases_its_lease(s3_bucket: str) -> None:
    """The end of a script that never called close(), normally or by an uncaught exception, deletes its lease while
    s3fs can still send requests (the threads' exit hooks run before the interpreter shuts its thread pools down):
    the relaunch takes the folder at once, and only a killed process leaves its lease behind (tests/test_lease.py)."""
    fs = fsspec.filesystem("s3")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    runs = {
        how: subprocess.Popen(
            [sys.executable, "-c", _ENDS_WITHOUT_CLOSE, f"{s3_bucket}/{how}", how],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for how in ("end", "raise")
    }
    try:
        ended = {how: (proc.communicate(timeout=90), proc.returncode) for how, proc in runs.items()}
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    (_, end_err), end_code = ended["end"]
    (_, raise_err), raise_code = ended["raise"]
    assert end_code == 0 and "could not" not in end_err, end_err[-3000:]
    assert raise_code == 1 and "training crashed after resume" in raise_err, raise_err[-3000:]
    assert "could not" not in raise_err, raise_err[-3000:]
    # the pending save_async completed before the lease went; the crashed run had taken the (empty) prefix only
    assert _names(fs, f"{s3_bucket}/end") == ["ckpt_00000001.pt", "ckpt_00000002.pt"]
    assert not fs.exists(f"{s3_bucket}/raise/{LEASE_NAME}")
    for how in runs:
        with dr.CheckpointManager(f"{s3_bucket}/{how}", model=nn.Linear(512, 512)) as relaunch:
            relaunch.resume()  # not refused: no lease left behind
            relaunch.save(3)
