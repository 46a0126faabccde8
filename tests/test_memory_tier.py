"""CheckpointManager.snapshot() in one process: what a restart resumes from, what reaches the folder, and the refusals.

A restart is a new process (the first one ended by ``os._exit``, as a kill would: no close(), no exit hooks);
``DIST_RESUME_SHM_DIR`` keeps the snapshots in the test's folder. The torchrun cases are tests/dist/test_memory_tier.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._memory import place
from tests.accelerator import Accel, on_accelerators

SCRIPT = textwrap.dedent(
    """
    import os, sys, torch, dist_resume as dr
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
    result = mgr.resume()
    print("resumed", None if result is None else (result.step, result.source), flush=True)
    step = result.step if result is not None else 0
    for step in range(step + 1, int(sys.argv[2]) + 1):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.snapshot(step)
        if step % 5 == 0:
            mgr.save(step)
    if sys.argv[3] == "die":
        os._exit(0)
    mgr.close()
    """
)


def _run(tmp_path: Path, steps: int, end: str) -> str:
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), str(steps), end],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def _list(tmp_path: Path) -> str:
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm")}
    cmd = [sys.executable, "-m", "dist_resume", "list", str(tmp_path / "run")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_restart_resumes_from_memory_and_close_copies_the_newest_then_frees_it(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    first = _run(tmp_path, 7, "die")
    assert "resumed None" in first and "copied from shared memory" in first  # save(5) copied snapshot 5
    listed = _list(tmp_path)  # dist-resume list shows them beside the folder's checkpoints
    assert "step 7" in listed and "step 6" in listed and "not in the folder yet" in listed, listed
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000005.pt"]
    second = _run(tmp_path, 9, "close")
    assert "resumed (7, 'memory')" in second, second
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000005.pt", "ckpt_00000009.pt"]
    assert list((tmp_path / "shm").iterdir()) == []
    assert "snapshots in this node's shared memory" not in _list(tmp_path)
    third = _run(tmp_path, 9, "close")  # nothing in memory now: the folder's newest
    assert "resumed (9, 'folder')" in third, third


def test_a_damaged_snapshot_is_never_resumed(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    _run(tmp_path, 7, "die")
    newest = max((tmp_path / "shm").rglob("state.*.pt"), key=lambda p: p.stat().st_mtime)
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    out = _run(tmp_path, 7, "close")
    assert "resumed (6, 'memory')" in out, out  # the other slot: the snapshot before it
    assert "CRC" in out or "crc" in out.lower(), out  # one WARNING says why


def test_snapshots_need_shared_memory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(place, "shm_root", lambda: None)
    monkeypatch.delenv(place.SHM_DIR_ENV, raising=False)
    with dr.CheckpointManager(tmp_path / "run", model=torch.nn.Linear(2, 2)) as mgr:
        with pytest.raises(dr.errors.UsageError, match="shared memory"):
            mgr.snapshot(1)
        assert mgr.resume() is None  # resume does not need it


def test_an_error_in_a_with_block_copies_the_newest_snapshot_and_keeps_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    model = torch.nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="the loop failed"):
        with dr.CheckpointManager(tmp_path / "run", model=model) as mgr:
            mgr.snapshot(1)
            mgr.snapshot(2)
            raise RuntimeError("the loop failed")
    assert [p.name for p in (tmp_path / "run").glob("ckpt_*")] == ["ckpt_00000002.pt"]  # copied
    assert len(list((tmp_path / "shm").rglob("state.*.pt"))) == 2  # kept for the restart
    with dr.CheckpointManager(tmp_path / "run", model=torch.nn.Linear(2, 2)) as again:
        result = again.resume()
        assert result is not None and (result.step, result.source) == (2, "memory")
    assert list((tmp_path / "shm").iterdir()) == []  # a clean close frees them


@on_accelerators(2)
def test_a_snapshot_of_a_model_on_a_second_device_resumes_onto_that_device(
    accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    device = accelerator.device(1)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4, device=device)).sum().backward()
    opt.step()
    with pytest.raises(RuntimeError, match="preempted"), dr.CheckpointManager(tmp_path / "run", model=model) as mgr:
        mgr.snapshot(1, optimizer=opt)
        raise RuntimeError("preempted")  # the snapshots stay for the restart
    fresh = torch.nn.Linear(4, 2).to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with dr.CheckpointManager(tmp_path / "run", model=fresh, optimizer=fresh_opt) as again:
        result = again.resume()
    assert result is not None and (result.step, result.source) == (1, "memory")
    for mine, theirs in zip(fresh.parameters(), model.parameters()):
        assert mine.device == device and torch.equal(mine.cpu(), theirs.cpu())
    moments = [s["exp_avg"] for s in fresh_opt.state.values()]
    assert moments and all(m.device == device for m in moments)  # torch's policy: beside its parameter
    fresh_opt.step()  # no "Expected all tensors to be on the same device"
