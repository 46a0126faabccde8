"""The node-local snapshot store in shared memory (dist_resume._shm): double-buffered, complete only once
committed, never reading what another user or folder wrote, and clear about a full /dev/shm."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._shm import (
    SHM_DIR_ENV,
    FileLayout,
    Region,
    Snapshot,
    begin_copy,
    begin_snapshot,
    held_bytes,
    mark_persisted,
    newest_snapshot,
    persist_snapshot,
    place,
    release_mappings,
    remove_snapshots,
    size_estimate,
    slots,
    snapshots,
    store_dir,
    write_snapshot,
)
from dist_resume._shm.layout import crc32_combine
from dist_resume.errors import CheckpointCorruptError, CheckpointWriteError, UsageError

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "shm"
    root.mkdir()
    monkeypatch.setenv(SHM_DIR_ENV, str(root))
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    path = tmp_path / "ckpts"
    path.mkdir()
    return path


def _payload(step: int, n: int = 64) -> dict[str, object]:
    return {"step": step, "model": {"w": torch.full((n,), float(step))}}


def _snap(folder: Path, step: int, n: int = 64, **kw: Any) -> Snapshot:
    payload = _payload(step, n)
    return write_snapshot(folder, step, lambda f: torch.save(payload, f), size_hint=size_estimate(n * 4, 1), **kw)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "dist_resume"]


def _record(snapshot: Snapshot) -> Path:
    return snapshot.path.with_suffix(".json")


def test_a_snapshot_round_trips_as_a_standard_torch_file(shm: Path, folder: Path) -> None:
    snap = _snap(folder, 7, metadata={"world_size": 2, "epoch": 1})
    assert newest_snapshot(folder) == snap
    assert (snap.step, snap.part, snap.persisted, dict(snap.metadata)) == (
        7,
        "state",
        False,
        {"world_size": 2, "epoch": 1},
    )
    loaded = torch.load(snap.path, weights_only=True)
    assert loaded["step"] == 7 and torch.equal(loaded["model"]["w"], torch.full((64,), 7.0))
    again = dr.load_checkpoint(snap.path, map_location="cpu")
    assert torch.equal(again["model"]["w"], loaded["model"]["w"])
    store = store_dir(folder)
    assert store is not None and store.parent == shm
    assert store.name.startswith(f"dist_resume-{os.getuid()}-") and len(store.name.rsplit("-", 1)[1]) == 16
    assert (store.stat().st_mode & 0o777) == 0o700
    assert json.loads(_record(snap).read_text())["folder"] == str(folder.resolve())
    assert snap.size == snap.path.stat().st_size and held_bytes(folder) == snap.size + _record(snap).stat().st_size


def test_two_slots_keep_the_two_newest_and_never_overwrite_the_newest(shm: Path, folder: Path) -> None:
    slots = [_snap(folder, step).slot for step in (1, 2, 3)]
    assert slots == ["a", "b", "a"]
    assert [s.step for s in snapshots(folder)] == [2, 3]
    pending = begin_snapshot(folder, 4, lambda f: torch.save(_payload(4), f), size_hint=2**16)
    newest = newest_snapshot(folder)  # data of step 4 written, not committed: step 3 stays the newest, whole
    assert newest is not None and newest.step == 3 and newest.slot == "a" and pending.path.name == "state.b.pt"
    assert torch.load(newest.path, weights_only=True)["step"] == 3
    with pytest.raises(UsageError, match="still being written"):
        begin_snapshot(folder, 5, lambda f: None, size_hint=0)
    committed: list[Snapshot] = []
    worker = threading.Thread(target=lambda: committed.append(pending.commit()))  # the commit may run in a thread
    worker.start()
    worker.join()
    assert committed[0].step == 4 and newest_snapshot(folder) == committed[0]
    assert [s.step for s in snapshots(folder)] == [3, 4]
    with pytest.raises(UsageError, match="already committed"):
        pending.commit()


def test_a_dump_that_fails_midway_leaves_the_previous_snapshot_the_newest(shm: Path, folder: Path) -> None:
    first = _snap(folder, 1)

    def broken(f: object) -> None:
        f.write(b"PK\x03\x04" + bytes(4096))  # type: ignore[attr-defined]
        raise ValueError("boom in the middle")

    with pytest.raises(ValueError, match="boom"):
        write_snapshot(folder, 2, broken, size_hint=2**16)
    assert newest_snapshot(folder) == first
    assert not (first.path.parent / "state.b.pt").exists()  # the partial file is gone
    assert held_bytes(folder) == first.size + _record(first).stat().st_size
    with pytest.raises(CheckpointWriteError, match="shm-size"):  # an ENOSPC the dump itself raised
        write_snapshot(folder, 2, lambda f: _raise(OSError(errno.ENOSPC, "No space left on device")), size_hint=1)
    assert newest_snapshot(folder) == first and _snap(folder, 3).step == 3  # the pending claim was released


def _raise(err: BaseException) -> None:
    raise err


_KILLED_CHILD = """
import os, sys, time, torch
from dist_resume._shm import begin_snapshot, write_snapshot
from pathlib import Path
folder, marker = Path(sys.argv[1]), sys.argv[2]
write_snapshot(folder, 1, lambda f: torch.save({"step": 1, "w": torch.ones(4)}, f), size_hint=2**20)
class Slow:
    def __init__(self, f):
        self.f, self.n = f, 0
    def write(self, b):
        n = self.f.write(b)
        self.n += n
        if self.n > 2**20 and not os.path.exists(marker):
            open(marker, "w").close()
            time.sleep(120)
        return n
    def __getattr__(self, name):
        return getattr(self.f, name)
big = {"step": 2, "a": torch.zeros(2**22), "b": torch.zeros(2**22)}
begin_snapshot(folder, 2, lambda f: torch.save(big, Slow(f)), size_hint=2**26)
"""


def test_a_process_killed_in_the_middle_of_a_dump_leaves_the_previous_snapshot(
    shm: Path, folder: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "halfway"
    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CHILD, str(folder), str(marker)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not marker.exists():
            assert child.poll() is None, f"the child ended early with {child.returncode}"
            assert time.monotonic() < deadline, "the child never reached the middle of its dump"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=30)
    newest = newest_snapshot(folder)
    assert newest is not None and newest.step == 1 and newest.slot == "a"
    assert torch.load(newest.path, weights_only=True)["step"] == 1
    partial = newest.path.parent / "state.b.pt"
    assert partial.stat().st_size > 2**20
    assert held_bytes(folder) == newest.size + _record(newest).stat().st_size + partial.stat().st_size
    after = _snap(folder, 3)  # the next write takes the slot without a record
    assert after.slot == "b" and [s.step for s in snapshots(folder, verify=True)] == [1, 3]


def test_a_damaged_data_file_is_never_returned_when_verified(
    shm: Path, folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = _snap(folder, 1), _snap(folder, 2)
    data = bytearray(second.path.read_bytes())
    data[len(data) // 2] ^= 0x01
    second.path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert newest_snapshot(folder, verify=True) == first
    (warned,) = _warnings(caplog)
    assert "CRC-32" in warned and "step 2" in warned
    assert newest_snapshot(folder, verify=False) == second  # the size still matches: only the CRC finds it
    caplog.clear()
    with second.path.open("r+b") as f:
        f.truncate(100)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert newest_snapshot(folder, verify=False) == first
    assert len(_warnings(caplog)) == 1


_HOSTILE = {
    "not JSON": lambda r: b"{not json",
    "invalid UTF-8": lambda r: b'{"step": "\xff\xfe"}',
    "a list": lambda r: b"[1, 2, 3]",
    "deep nesting": lambda r: b"[" * 100_000 + b"]" * 100_000,
    "a huge integer": lambda r: json.dumps(r).replace(f'"step": {r["step"]}', '"step": ' + "9" * 5000).encode(),
    "step past int64": lambda r: json.dumps({**r, "step": 2**70}).encode(),
    "negative step": lambda r: json.dumps({**r, "step": -1}).encode(),
    "bool step": lambda r: json.dumps({**r, "step": True}).encode(),
    "str step": lambda r: json.dumps({**r, "step": "2"}).encode(),
    "float size": lambda r: json.dumps({**r, "size": 1.5}).encode(),
    "crc past 32 bits": lambda r: json.dumps({**r, "crc32": 2**32}).encode(),
    "NaN created": lambda r: json.dumps({**r, "created": float("nan")}).encode(),
    "huge created": lambda r: json.dumps({**r, "created": 10**400}).encode(),
    "missing step": lambda r: json.dumps({k: v for k, v in r.items() if k != "step"}).encode(),
    "missing metadata": lambda r: json.dumps({k: v for k, v in r.items() if k != "metadata"}).encode(),
    "list metadata": lambda r: json.dumps({**r, "metadata": [1]}).encode(),
    "another folder": lambda r: json.dumps({**r, "folder": "/elsewhere/ckpts"}).encode(),
    "a file outside": lambda r: json.dumps({**r, "file": "../../etc/passwd"}).encode(),
    "another uid": lambda r: json.dumps({**r, "uid": os.getuid() + 1}).encode(),
    "another version": lambda r: json.dumps({**r, "version": 99}).encode(),
    "str persisted": lambda r: json.dumps({**r, "persisted": "yes"}).encode(),
    "too large": lambda r: json.dumps({**r, "metadata": {"x": "y" * 70_000}}).encode(),
}


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_hostile_record_is_ignored_with_one_warning(
    shm: Path, folder: Path, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    first, second = _snap(folder, 1), _snap(folder, 2)
    record = _record(second)
    record.write_bytes(_HOSTILE[case](json.loads(record.read_text())))
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert newest_snapshot(folder) == first
    assert len(_warnings(caplog)) == 1, _warnings(caplog)
    assert _snap(folder, 3).slot == "b"  # the slot without a valid record is the one written next
    assert [s.step for s in snapshots(folder)] == [1, 3]


def test_another_folders_snapshots_never_match(shm: Path, folder: Path, tmp_path: Path, caplog) -> None:
    other = tmp_path / "other"
    snap = _snap(folder, 5)
    assert snapshots(other) == [] and newest_snapshot(other) is None
    store = store_dir(other)
    assert store is not None and store != snap.path.parent
    store.mkdir(mode=0o700)  # a hash collision: the other folder's directory holds this folder's files
    for f in snap.path.parent.iterdir():
        (store / f.name).write_bytes(f.read_bytes())
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert snapshots(other) == []
    (warned,) = _warnings(caplog)
    assert "another checkpoint folder" in warned


def test_another_users_directory_or_file_is_never_read(
    shm: Path, folder: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    snap = _snap(folder, 1)
    real_uid = os.getuid()
    stranger = real_uid + 4242
    monkeypatch.setattr(os, "getuid", lambda: stranger)  # this process is now another user: the directory is not its
    theirs = store_dir(folder)
    assert theirs is not None
    theirs.mkdir(mode=0o700)  # created by the real uid under the name the "other user" would use
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert snapshots(folder) == [] and newest_snapshot(folder) is None and held_bytes(folder) == 0
    assert len(_warnings(caplog)) == 3 and all(f"uid {real_uid}" in w for w in _warnings(caplog))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        second = _snap(folder, 2)  # the name is taken: a directory of this user's own beside it, said once
    assert second.path.parent.name.startswith(f"{theirs.name}.") and second.path.parent != theirs
    assert len(_warnings(caplog)) == 1 and "another user took its name" in _warnings(caplog)[0]
    monkeypatch.setattr(os, "getuid", lambda: real_uid)  # (found again after a restart: tests/test_memory_history.py)
    caplog.clear()
    link = theirs.with_name(f"dist_resume-{real_uid}-link")
    link.symlink_to(snap.path.parent)
    assert place.owned_store(link) is False  # a symlinked directory is refused, not followed
    if real_uid == 0:  # a record owned by another uid inside our own directory
        os.chown(_record(snap), 12345, 12345)
        with caplog.at_level(logging.WARNING, logger="dist_resume"):
            assert snapshots(folder) == []
        assert "owned by uid 12345" in _warnings(caplog)[-1]


def test_too_little_shared_memory_is_refused_before_anything_is_touched(
    shm: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = _snap(folder, 1), _snap(folder, 2)
    real = os.statvfs

    class Tiny:
        def __init__(self, st: os.statvfs_result) -> None:
            self.f_frsize, self.f_bavail = st.f_frsize, 0

    monkeypatch.setattr(os, "statvfs", lambda p: Tiny(real(p)))
    with pytest.raises(CheckpointWriteError) as caught:
        write_snapshot(folder, 3, lambda f: torch.save(_payload(3), f), size_hint=2**30)
    message = str(caught.value)
    assert "needs 1.0 GiB" in message and "--shm-size" in message and SHM_DIR_ENV in message
    assert "medium: Memory" in message and "previous snapshot is untouched" in message
    assert snapshots(folder, verify=True) == [first, second]  # the older slot's record was not removed either


def test_enospc_in_a_real_tiny_tmpfs(tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mount = tmp_path / "tiny"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        monkeypatch.setenv(SHM_DIR_ENV, str(mount))
        first = _snap(folder, 1, n=1024)
        big = {"step": 2, "w": torch.ones(2**19)}  # 2 MiB into a 1 MiB tmpfs, with a hint that lies
        with pytest.raises(CheckpointWriteError, match="shm-size"):
            write_snapshot(folder, 2, lambda f: torch.save(big, f), size_hint=1)
        assert newest_snapshot(folder) == first and not (first.path.parent / "state.b.pt").exists()
        assert torch.load(first.path, weights_only=True)["step"] == 1
        remove_snapshots(folder)
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def test_persist_copies_the_snapshot_byte_for_byte_and_marks_it(shm: Path, folder: Path) -> None:
    snap = _snap(folder, 4, n=300_000)
    dest = persist_snapshot(snap, folder / "ckpt_00000004.pt")
    assert dest == folder / "ckpt_00000004.pt" and dest.read_bytes() == snap.path.read_bytes()
    assert dr.load_checkpoint(dest, map_location="cpu")["step"] == 4
    marked = mark_persisted(snap)
    assert marked is not None and marked.persisted and newest_snapshot(folder) == marked
    _snap(folder, 5)
    _snap(folder, 6)  # slot a now holds step 6: the record of step 4 is gone, so is the right to mark it
    assert mark_persisted(snap) is None and newest_snapshot(folder).persisted is False  # type: ignore[union-attr]
    newest = newest_snapshot(folder)
    assert newest is not None
    data = bytearray(newest.path.read_bytes())
    data[-30] ^= 0xFF
    newest.path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match="damaged or overwritten"):
        persist_snapshot(newest, folder / "ckpt_00000006.pt")
    assert sorted(p.name for p in folder.glob("*ckpt_*")) == ["ckpt_00000004.pt"]  # no file, no temporary left


def test_remove_leaves_nothing_behind(shm: Path, folder: Path) -> None:
    a = _snap(folder, 1)
    _snap(folder, 2)
    rank3 = _snap(folder, 2, part="rank3")
    assert {s.part for s in snapshots(folder)} == {"state", "rank3"}
    assert held_bytes(folder) == sum(s.size + _record(s).stat().st_size for s in snapshots(folder))
    remove_snapshots(folder, keep=[rank3])
    assert snapshots(folder) == [rank3]
    size = rank3.size + _record(rank3).stat().st_size
    assert remove_snapshots(folder) == size
    assert not a.path.parent.exists() and list(shm.iterdir()) == [] and held_bytes(folder) == 0


def test_bad_arguments_and_no_shared_memory(shm: Path, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="not JSON"):
        _snap(folder, 1, metadata={"x": object()})
    with pytest.raises(UsageError, match="part"):
        _snap(folder, 1, part="../x")
    with pytest.raises(UsageError, match="step"):
        write_snapshot(folder, True, lambda f: None, size_hint=0)  # type: ignore[arg-type]
    monkeypatch.delenv(SHM_DIR_ENV)
    monkeypatch.setattr(place, "_DEFAULT_ROOT", shm / "absent")
    assert snapshots(folder) == [] and newest_snapshot(folder) is None and held_bytes(folder) == 0
    with pytest.raises(UsageError, match="Linux shared memory"):
        _snap(folder, 1)
    monkeypatch.setenv(SHM_DIR_ENV, str(shm / "absent"))
    with pytest.raises(UsageError, match="not a directory"):
        snapshots(folder)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm on this machine")
def test_the_real_dev_shm(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHM_DIR_ENV, raising=False)
    try:
        snap = _snap(folder, 9)
        assert snap.path.parent.parent == Path("/dev/shm")
        assert torch.load(snap.path, weights_only=True)["step"] == 9
    finally:
        remove_snapshots(folder)
    store = store_dir(folder)
    assert store is not None and not store.exists()


def test_a_snapshot_of_a_saved_checkpoint_resumes_with_dist_resume(shm: Path, folder: Path, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    saved = dr.save_checkpoint(tmp_path / "saved.pt", model=model, optimizer=optimizer, step=3)
    data = Path(saved).read_bytes()
    snap = write_snapshot(folder, 3, lambda f: f.write(data), size_hint=len(data))
    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    result = dr.resume(snap.path, model=fresh, optimizer=fresh_opt)
    assert result.step == 3 and torch.equal(fresh.weight, model.weight)
    assert torch.equal(
        fresh_opt.state[fresh.weight]["momentum_buffer"], optimizer.state[model.weight]["momentum_buffer"]
    )


def test_a_store_folder_is_named_by_its_url_and_persists_to_the_store(shm: Path) -> None:
    pytest.importorskip("fsspec")
    from dist_resume._store.url import location

    url = "memory://memory-store-test/run"
    where = location(url)  # what the manager passes down: the folder resolved once
    snap = write_snapshot(where, 2, lambda f: torch.save(_payload(2), f), size_hint=2**16)
    assert snap.folder == url and newest_snapshot(where) == snap
    assert snapshots(location("memory://memory-store-test/other")) == []
    try:
        dest = persist_snapshot(snap, where / "ckpt_00000002.pt")
        assert str(dest) == f"{url}/ckpt_00000002.pt" and dest.read_bytes() == snap.path.read_bytes()
        assert dr.load_checkpoint(dest, map_location="cpu")["step"] == 2
    finally:
        remove_snapshots(where)
        import fsspec

        fsspec.filesystem("memory").rm("/memory-store-test", recursive=True)


# --- a file laid out beforehand, copied into slots kept mapped (begin_copy) ---


def _layout(n: int, *, head: bytes = b"HEAD") -> FileLayout:
    """A file of a header, one region of ``n`` bytes at offset 64 and a 16-byte tail; the region's CRC-32 goes right
    after it and into the tail's last 4 bytes."""
    size = 64 + n + 4 + 16
    region = Region(64, n, (64 + n, size - 4))
    return FileLayout(size, ((0, head.ljust(64, b"\0")), (64 + n, bytes(20))), (region,))


def _fill(value: int, n: int) -> Any:
    def fill(path: Path, mm: Any) -> None:
        mm[64 : 64 + n] = bytes([value]) * n

    return fill


def test_crc32_combine_is_zlibs() -> None:
    data = os.urandom(3000)
    for cut in (0, 1, 7, 1500, 2999, 3000):
        a, b = data[:cut], data[cut:]
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(data), cut
    assert crc32_combine(0x12345678, zlib.crc32(b""), 0) == 0x12345678


def test_a_copied_snapshot_is_sealed_at_its_commit_and_not_used_before(shm: Path, folder: Path) -> None:
    n = 2 * 2**20
    first = begin_copy(folder, 1, _layout(n), _fill(1, n)).commit()
    data = first.path.read_bytes()
    assert first.size == len(data) == 64 + n + 20 and first.crc32 == zlib.crc32(data)
    crc = zlib.crc32(bytes([1]) * n)
    assert data[64 + n : 68 + n] == data[-4:] == crc.to_bytes(4, "little")  # sealed: the region's CRC-32 in place
    pending = begin_copy(folder, 2, _layout(n), _fill(2, n))
    assert pending.path.read_bytes()[64:65] == b"\x02"  # the data is in the slot, its CRC-32 not yet
    assert newest_snapshot(folder) == first and [s.step for s in snapshots(folder)] == [1]  # not used before
    second = pending.commit()
    assert newest_snapshot(folder) == second and second.crc32 == zlib.crc32(second.path.read_bytes())
    with second.path.open("r+b") as f:  # damaged in memory after its commit: refused, the other slot's is the newest
        f.seek(64 + n // 2)
        f.write(b"\x10")
    assert newest_snapshot(folder, verify=True) == first


def test_a_slot_is_reused_across_snapshots_not_made_anew(shm: Path, folder: Path) -> None:
    n = 2**20
    first = begin_copy(folder, 1, _layout(n), _fill(1, n)).commit()
    other = first.path.with_name("state.b.pt")
    assert other.stat().st_size == first.size  # the other slot made and mapped at the first commit
    inodes = {s: os.stat(first.path.with_name(f"state.{s}.pt")).st_ino for s in "ab"}
    mappings = {s: slots.mapped(first.path.with_name(f"state.{s}.pt"), first.size) for s in "ab"}
    assert None not in mappings.values()
    for step in (2, 3, 4):
        snap = begin_copy(folder, step, _layout(n), _fill(step, n)).commit()
        assert os.stat(snap.path).st_ino == inodes[snap.slot]  # the same file: no unlink, no ftruncate
        assert slots.mapped(snap.path, snap.size) is mappings[snap.slot]  # the same mapping: no new page faults
        assert snap.path.read_bytes()[64 + n - 1] == step and snap.crc32 == zlib.crc32(snap.path.read_bytes())
    held = os.open(first.path, os.O_RDONLY)  # slot a, which the next snapshot takes
    try:
        grown = begin_copy(folder, 5, _layout(2 * n), _fill(5, 2 * n)).commit()  # another size: a new file
        assert grown.slot == "a" and os.fstat(held).st_nlink == 0  # the old one was unlinked, not resized
        assert os.fstat(held).st_size == first.size  # a reader holding it keeps it whole
    finally:
        os.close(held)
    assert slots.mapped(grown.path, grown.size) is not mappings["a"] and grown.size == 64 + 2 * n + 20
    assert [s.step for s in snapshots(folder, verify=True)] == [4, 5]
    remove_snapshots(folder)  # the mappings go with the files: their memory is freed
    assert all(slots.mapped(first.path.with_name(f"state.{s}.pt"), size) is None for s in "ab" for size in (n, 2 * n))
    assert list(shm.iterdir()) == []


def test_a_copy_that_fails_leaves_the_previous_snapshot(
    shm: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 4096
    first = begin_copy(folder, 1, _layout(n), _fill(1, n)).commit()
    partial = first.path.with_name("state.b.pt")

    def broken(path: Path, mm: Any) -> None:
        mm[64:68] = b"half"
        raise ValueError("boom in the copy")

    with pytest.raises(ValueError, match="boom"):
        begin_copy(folder, 2, _layout(n), broken)
    assert newest_snapshot(folder) == first and not partial.exists() and slots.mapped(partial, first.size) is None
    with monkeypatch.context() as patched, pytest.raises(CheckpointWriteError, match="shm-size"):
        patched.setattr(os, "posix_fallocate", lambda fd, o, n: _raise(OSError(errno.ENOSPC, "No space left")))
        begin_copy(folder, 2, _layout(n), _fill(2, n))  # a full tmpfs: ENOSPC before a byte is copied
    assert newest_snapshot(folder) == first and not partial.exists()
    assert begin_copy(folder, 3, _layout(n), _fill(3, n)).commit().slot == "b"  # the claim was released


def test_a_slot_replaced_before_its_commit_is_not_committed(shm: Path, folder: Path) -> None:
    n = 4096
    pending = begin_copy(folder, 1, _layout(n), _fill(1, n))
    pending.path.unlink()
    pending.path.write_bytes(bytes(pending.size))  # another writer's file under the slot's name
    with pytest.raises(CheckpointWriteError, match="removed or replaced"):
        pending.commit()
    assert snapshots(folder) == [] and not pending.path.exists()
    with pytest.raises(ValueError, match="overlaps"):
        FileLayout(100, (), (Region(10, 50, ()), Region(40, 10, ())))
    with pytest.raises(ValueError, match="must go after it"):
        FileLayout(100, (), (Region(10, 50, (20,)),))


def test_another_process_attaches_to_the_writers_slot_and_keeps_its_mapping(shm: Path, folder: Path) -> None:
    n = 4096
    first = begin_copy(folder, 1, _layout(n), _fill(1, n)).commit()
    writers = slots.mapped(first.path, first.size)
    slots.forget(first.path)  # from here this process stands for another local rank: no mapping of its own
    mm = slots.attach_slot(first.path, first.size)
    assert mm is not writers and slots.attach_slot(first.path, first.size) is mm  # kept across snapshots
    mm[64:68] = b"peer"
    assert first.path.read_bytes()[64:68] == b"peer"  # the writer's file, shared
    inode = first.path.stat().st_ino
    first.path.unlink()
    first.path.write_bytes(bytes(first.size))  # the writer made the slot anew
    again = slots.attach_slot(first.path, first.size)
    assert again is not mm and first.path.stat().st_ino != inode  # the old file's mapping held its inode
    with pytest.raises(OSError):
        slots.attach_slot(first.path, first.size + 1)  # never resized
    assert first.path.stat().st_size == first.size
    other = first.path.with_name("state.b.pt")
    other.write_bytes(bytes(first.size))
    slots.attach_slot(other, first.size)
    first.path.unlink()  # removed by the writer: the next attach drops this process's stale mapping of it
    slots.attach_slot(other, first.size)
    assert slots.mapped(first.path, first.size) is None
    release_mappings(folder)
    assert slots.mapped(other, first.size) is None
    with pytest.raises(FileNotFoundError):
        slots.attach_slot(first.path, first.size)  # never creates one
