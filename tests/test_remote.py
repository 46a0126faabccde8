"""A CheckpointManager on an object store, on ``memory://`` (fsspec's in-process store): the fast unit tests of
rotation after commit, the lease, fallback past damage, uncommitted sharded folders, ranged reads bounded by one window.
tests/test_s3.py runs the same flows against a real S3-protocol server."""

from __future__ import annotations

import gc
import logging
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._core.location import RemotePath
from dist_resume._format import ranged
from dist_resume._manager.lease import LEASE_NAME, PrefixLease
from dist_resume._manager.lease_object import Lease
from dist_resume._store.ranges import READ_STATS
from dist_resume.errors import CheckpointCorruptError, CheckpointWriteError, KeyMismatchError

fsspec = pytest.importorskip("fsspec")


def _names(url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[1] for p in fsspec.filesystem("memory").ls(url, detail=False))


def _net(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 2))


def test_save_rotate_resume_and_the_lease(mem: str) -> None:
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mgr = dr.CheckpointManager(mem, model=model, optimizer=opt, keep_last=2)
    assert mgr.resume() is None and mgr.checkpoints() == [] and mgr.latest() is None
    assert _names(mem) == [LEASE_NAME]
    for step in (10, 20, 30):
        model(torch.ones(1, 6)).sum().backward()
        opt.step()
        mgr.save(step)
    assert [p.name for p in mgr.checkpoints()] == ["ckpt_00000020.pt", "ckpt_00000030.pt"]
    assert _names(mem) == [LEASE_NAME, "ckpt_00000020.pt", "ckpt_00000030.pt"]
    with pytest.raises(CheckpointWriteError, match="leased by host") as info:
        dr.CheckpointManager(mem, model=_net()).save(40)
    assert "expires in" in str(info.value)
    mgr.close()
    assert _names(mem) == ["ckpt_00000020.pt", "ckpt_00000030.pt"]  # released: the lease is gone
    fresh, fresh_opt = _net(seed=1), None
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with dr.CheckpointManager(mem, model=fresh, optimizer=fresh_opt) as again:
        result = again.resume()
        assert result is not None and result.step == 30 and isinstance(result.path, RemotePath)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert all(
        torch.equal(a["momentum_buffer"], b["momentum_buffer"])
        for a, b in zip(opt.state.values(), fresh_opt.state.values())
    )


def test_an_expired_lease_is_taken_over_and_a_lost_one_refuses_the_next_save(mem: str) -> None:
    fs = fsspec.filesystem("memory")
    dead = Lease("elsewhere", 4242, time.time() - 200, time.time() - 1, "f" * 32)
    fs.pipe_file(f"{mem}/{LEASE_NAME}", dead.to_json())
    with dr.CheckpointManager(mem, model=_net(), keep_last=1) as mgr:
        mgr.save(1)  # the dead job's lease was ignored and replaced
        mine = Lease.from_json(fs.cat_file(f"{mem}/{LEASE_NAME}"))
        assert mine is not None and mine.pid != 4242 and mine.expires > time.time()
        fs.pipe_file(f"{mem}/{LEASE_NAME}", dead.to_json())  # another job took it while this one stalled
        lease = mgr._lock
        assert isinstance(lease, PrefixLease)
        lease._lost = "its lease object was replaced by elsewhere pid 4242"  # what the renewing thread sees
        with pytest.raises(CheckpointWriteError, match="lost its lease"):
            mgr.save(2)


def test_a_resume_that_raises_leaves_nothing_held(mem: str, tmp_path: Path) -> None:
    """The lease (and the local lock) a failed resume took is released at once: the fixed script relaunches into
    the folder without waiting for the lease to expire; a lock held before the resume stays held."""
    for folder in (mem, str(tmp_path)):
        with dr.CheckpointManager(folder, model=_net()) as mgr:
            mgr.save(1)
        wrong = dr.CheckpointManager(folder, model=nn.Linear(3, 3))
        with pytest.raises(KeyMismatchError):
            wrong.resume()
        assert not wrong._lock.held
        if folder == mem:
            assert LEASE_NAME not in _names(mem)
        with dr.CheckpointManager(folder, model=_net()) as relaunch:
            result = relaunch.resume()
            assert result is not None and result.step == 1
            relaunch.save(2)
            with pytest.raises(KeyMismatchError):
                relaunch.resume(model=nn.Linear(3, 3))
            assert relaunch._lock.held  # taken by the save before: the resume leaves it as it found it


def test_a_damaged_newest_object_is_skipped_and_an_uncommitted_sharded_folder_never_counts(
    mem: str, caplog: pytest.LogCaptureFixture
) -> None:
    fs = fsspec.filesystem("memory")
    model = _net()
    with dr.CheckpointManager(mem, model=model, keep_last=3) as mgr:
        mgr.save(1)
        good = {k: v.clone() for k, v in model.state_dict().items()}
        with torch.no_grad():
            next(model.parameters()).add_(1)
        mgr.save(2)
    newest = f"{mem}/ckpt_00000002.pt"
    data = bytearray(fs.cat_file(newest))
    fs.pipe_file(newest, bytes(data[: len(data) - 100]))  # truncated: its directory is gone
    fs.pipe_file(f"{mem}/ckpt_00000003.dcp/__0_0.distcp", b"half a save")  # killed before its manifest
    fresh = _net(seed=5)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert dr.resume(mem, model=fresh).step == 1
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in good.items())
    assert [r for r in caplog.records if "skipping checkpoint" in r.message and "ckpt_00000002.pt" in r.message]
    with dr.CheckpointManager(mem, model=model, keep_last=3) as mgr:
        assert [p.name for p in mgr.checkpoints()] == ["ckpt_00000001.pt", "ckpt_00000002.pt"]  # no .dcp
        mgr.save(4)
    assert "ckpt_00000003.dcp" not in _names(mem)  # removed as the leftover of a killed save
    fs.pipe_file(f"{mem}/ckpt_00000001.pt", b"PK\x03\x04 not a zip")
    fs.pipe_file(f"{mem}/ckpt_00000004.pt", b"")
    with pytest.raises(CheckpointCorruptError, match="none is complete"):
        dr.resume(mem, model=fresh)


def test_a_resume_reads_the_object_by_ranges_through_one_window(mem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))  # 16 MiB of weights
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 1024)).sum().backward()
    opt.step()  # 32 MiB of optimizer state
    path = dr.save_checkpoint(f"{mem}/ckpt.pt", model=model, optimizer=opt, step=1)
    size = fsspec.filesystem("memory").size(str(path))
    monkeypatch.setattr(ranged, "DEFAULT_RANGE_BYTES", 1 << 20)
    live = nn.Sequential(nn.Linear(1024, 2048), nn.Linear(2048, 1024))
    live_opt = torch.optim.AdamW(live.parameters())
    live(torch.ones(1, 1024)).sum().backward()
    live_opt.step()  # its state exists already: the data goes into it in place
    gc.collect()
    READ_STATS.reset()
    tracemalloc.start()
    try:
        dr.resume(str(path), model=live, optimizer=live_opt)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, peak  # one 1 MiB window and the directory's pieces, never the 48 MiB object
    assert size <= READ_STATS.bytes < size + (2 << 20)  # every byte once (and the two ends of the directory)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), live.state_dict().values()))
    assert all(
        torch.equal(a["exp_avg_sq"], b["exp_avg_sq"]) for a, b in zip(opt.state.values(), live_opt.state.values())
    )
