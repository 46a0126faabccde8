"""CheckpointManager.snapshot() in one process: what a restart resumes from, what reaches the folder, and the refusals.

A restart is a new process (the first one ended by ``os._exit``, as a kill would: no close(), no exit hooks);
``DIST_RESUME_SHM_DIR`` keeps the snapshots in the test's folder. The torchrun cases are tests/dist/test_memory_tier.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._format.tensor_records import plan_records
from dist_resume._format.zip_layout import plan_layout
from dist_resume._format.zip_write import ZipWriter
from dist_resume._manager.snapshots import commit
from dist_resume._manager.snapshots.payload import laid_out
from dist_resume._shm import place, zip_file_layout
from dist_resume._shm.layout import seal
from tests.accelerator import Accel, on_accelerators
from tests.helpers import flip_byte_in_tensor_record

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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_snapshot_newer_than_the_folders_names_is_taken_without_reading_the_folder(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    _run(tmp_path, 7, "die")  # the folder: ckpt 5; shared memory: snapshots 6 and 7
    ckpt5 = tmp_path / "run" / "ckpt_00000005.pt"
    intact = ckpt5.read_bytes()
    flip_byte_in_tensor_record(ckpt5)  # damage only a CRC check finds: reading the file to check it would find it
    out = _run(tmp_path, 8, "die")
    assert "resumed (7, 'memory')" in out and "skipping checkpoint" not in out, out  # the folder's file never read
    # the newest name damaged (a copy cut short): the complete checkpoint before it is older than the snapshots,
    # which are still taken
    ckpt5.write_bytes(intact)
    (tmp_path / "run" / "ckpt_00000009.pt").write_bytes(b"PK\x03\x04 cut short")
    out = _run(tmp_path, 10, "close")
    assert "resumed (8, 'memory')" in out and "ckpt_00000009.pt" in out, out


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


def test_a_snapshot_is_one_copy_into_a_reused_slot_committed_in_the_background(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    monkeypatch.setattr(commit, "COMMIT_INLINE_BYTES", 0)  # every commit in the background, as a large state's
    (tmp_path / "shm").mkdir()
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    shared = torch.arange(6.0)
    extra = {
        "bf16": torch.randn(3, 5).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "view": torch.randn(4, 6)[:, 1],  # not contiguous: saved as its values
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "twice": [shared, shared],
    }
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt) as mgr:
        for step in (1, 2, 3):
            model(torch.ones(2, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.snapshot(step, extra=extra)
            if step == 1:
                mgr._memory._join_commit(raising=True)
                first = mgr._memory.newest
                assert first is not None and first.slot == "a"
                inode = first.path.stat().st_ino
        saved = mgr.save(
            3, extra=extra
        )  # nothing changed since snapshot(3): copied once its commit ends, the same bytes
        mgr._memory._join_copy()
        newest = mgr._memory.newest
        assert newest is not None and (newest.step, newest.slot) == (3, "a")
        assert newest.path.stat().st_ino == inode  # slot a's file from step 1, written again in place
        assert Path(saved).read_bytes() == newest.path.read_bytes()
        assert dr.tools.verify_archive(newest.path) == [] and zipfile.ZipFile(newest.path).testzip() is None
        loaded = torch.load(newest.path, weights_only=True)
    assert all(torch.equal(loaded["model"][k], v) for k, v in model.state_dict().items())
    for key, value in extra.items():
        if isinstance(value, torch.Tensor):
            assert loaded["extra"][key].dtype == value.dtype and torch.equal(loaded["extra"][key], value), key
    assert all(torch.equal(t, shared) for t in loaded["extra"]["twice"])
    assert list((tmp_path / "shm").iterdir()) == []  # close() waited for the commit, then freed everything


_UNCOMMITTED = textwrap.dedent(
    """
    import os, sys, threading, torch, dist_resume as dr
    from dist_resume._manager.snapshots import commit
    from dist_resume._shm import pending
    commit.COMMIT_INLINE_BYTES = 0
    sealed = pending.seal
    def seal(view, layout):  # the commit of step 2 never ends: the process dies first
        if threading.current_thread().name.endswith("-2"):
            threading.Event().wait()
        return sealed(view, layout)
    pending.seal = seal
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
    for step in (1, 2):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.snapshot(step)
        if step == 1:
            mgr._memory._join_commit(raising=True)
    print("snapshot(2) returned", flush=True)
    os._exit(0)  # as a SIGKILL: no exit hook, no SIGTERM handler
    """
)


def test_a_snapshot_whose_commit_did_not_end_is_not_resumed(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-c", _UNCOMMITTED, str(tmp_path / "run")]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "snapshot(2) returned" in out.stdout, out.stderr[-3000:]
    assert len(list((tmp_path / "shm").rglob("state.*.json"))) == 1  # step 2's data is there, its record is not
    second = _run(tmp_path, 3, "close")
    assert "resumed (1, 'memory')" in second, second  # the previous snapshot, whole


def test_a_payload_the_copy_cannot_take_is_saved_by_torch_save() -> None:
    plain = {"w": torch.ones(2), "n": 3}
    assert laid_out(plain) is not None
    assert laid_out({"w": torch.nn.Parameter(torch.ones(2))}) is None  # a subclass
    assert laid_out({"s": torch.ones(2).to_sparse()}) is None
    assert laid_out({"m": torch.empty(2, device="meta")}) is None
    in_a_set = laid_out({"in_a_set": {torch.ones(1)}})  # the pickle finds a tensor in any container torch.save enters
    assert in_a_set is not None and len(in_a_set.tensors) == 1


def _raw(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().view(torch.uint8).reshape(-1).tolist())


def test_the_laid_out_file_is_the_one_write_streamed_writes(tmp_path: Path) -> None:
    view = torch.randn(4, 6)[:, 1]
    payload = {
        "w": torch.randn(3, 4),
        "view": view,
        "empty": torch.empty(0, 3),
        "half": torch.randn(5).to(torch.bfloat16),
        "n": 3,
    }
    plan = plan_records(payload)
    laid = laid_out(payload)  # the snapshot's one-pass plan pickles the same data.pkl
    assert laid is not None and laid.pickled == plan.head[0][1] and laid.tensors == plan.tensors
    layout = zip_file_layout(plan_layout(plan.specs()), plan.small())
    data = bytearray(layout.size)
    for offset, fixed in layout.fixed:
        data[offset : offset + len(fixed)] = fixed
    filled = [t for t, n in zip(plan.tensors, plan.sizes) if n]
    assert len(layout.regions) == len(filled)
    for region, tensor in zip(layout.regions, filled):
        data[region.offset : region.offset + region.size] = _raw(tensor)
    seal(memoryview(data), layout)
    fd = os.open(tmp_path / "streamed.pt", os.O_RDWR | os.O_CREAT)
    try:
        writer = ZipWriter(fd)  # write_streamed's records of the same plan, one by one
        for name, small in plan.head:
            writer.add_bytes(name, small)
        for i, tensor in enumerate(plan.tensors):
            writer.add_bytes(plan.name(i), _raw(tensor))
        for name, small in plan.foot:
            writer.add_bytes(name, small)
        writer.finish()
    finally:
        os.close(fd)
    assert bytes(data) == (tmp_path / "streamed.pt").read_bytes()
    loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert torch.equal(loaded["view"], view) and loaded["half"].dtype == torch.bfloat16


def test_a_snapshot_of_the_same_structure_plans_nothing_again(tmp_path: Path) -> None:
    first = laid_out({"w": torch.ones(3, 4), "step": 1, "saved_at": 1.5})
    again = laid_out({"w": torch.zeros(3, 4), "step": 2, "saved_at": 2.5})  # the same sizes: the same places
    other = laid_out({"w": torch.ones(5, 4), "step": 3, "saved_at": 3.5})
    assert first is not None and again is not None and other is not None
    assert again.layout.regions is first.layout.regions and other.layout.regions is not first.layout.regions
    data = bytearray(again.layout.size)  # the bytes of data.pkl and the serialization id come with each snapshot
    for offset, fixed in again.layout.fixed:
        data[offset : offset + len(fixed)] = fixed
    data[again.records[0].offset : again.records[0].offset + 48] = _raw(torch.zeros(3, 4))
    seal(memoryview(data), again.layout)
    assert zipfile.ZipFile(io.BytesIO(bytes(data))).testzip() is None
    loaded = torch.load(io.BytesIO(bytes(data)), weights_only=True)
    assert loaded["step"] == 2 and torch.equal(loaded["w"], torch.zeros(3, 4))
