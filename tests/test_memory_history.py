"""Snapshots belong to their folder's history, records are trusted for nothing their data contradicts, and nobody can
take the store's name first (issue 45, items 3 and 4): the user script of tests/test_memory_tier.py (a snapshot every
step, a save every 5), ended by ``os._exit`` (as a kill) and relaunched, with the folder or shared memory changed in
between as a user, a bug or another user would change them."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._shm import IDENTITY_NAME, place
from tests.test_memory_tier import _run


def _stored(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "shm").rglob("state.*"))


def _folder(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "run").glob("ckpt_*"))


def test_a_folder_made_again_or_another_runs_never_resumes_older_snapshots(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    _run(tmp_path, 7, "die")  # the folder: ckpt 5; shared memory: snapshots 6 and 7 of this history
    identity = (tmp_path / "run" / IDENTITY_NAME).read_text().strip()
    assert len(identity) == 32 and len(_stored(tmp_path)) == 4
    (tmp_path / "run" / IDENTITY_NAME).write_text("0" * 32 + "\n")  # another run's folder at the same path
    out = _run(tmp_path, 8, "die")
    assert "resumed (5, 'folder')" in out and out.count("removed 2 snapshot(s)") == 1, out
    assert "steps 6, 7" in out, out
    # that run's own snapshots (6, 7 and 8 in two slots: 7 and 8) stay; then the folder is deleted and made again
    assert len(_stored(tmp_path)) == 4
    for path in (tmp_path / "run").iterdir():
        path.unlink()
    (tmp_path / "run").rmdir()
    out = _run(tmp_path, 2, "close")
    assert "resumed None" in out and "removed 2 snapshot(s)" in out and "steps 7, 8" in out, out
    assert _folder(tmp_path) == ["ckpt_00000002.pt"]  # its own newest step, nothing of the old history
    assert list((tmp_path / "shm").iterdir()) == []


def _record(tmp_path: Path, step: int) -> Path:
    for path in (tmp_path / "shm").rglob("state.*.json"):
        if json.loads(path.read_text())["step"] == step:
            return path
    raise AssertionError(f"no record of step {step}")


def test_a_record_is_trusted_for_nothing_its_data_contradicts(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    _run(tmp_path, 7, "die")
    record = _record(tmp_path, 7)
    fields = json.loads(record.read_text())
    record.write_text(json.dumps({**fields, "step": 2**32}))  # a record claiming another step over step 7's data
    out = _run(tmp_path, 9, "die")
    assert "resumed (6, 'memory')" in out and "its record says 4294967296" in out, out
    # a snapshot whose CRC-32 matches but whose content is no checkpoint: the slot before it
    record = _record(tmp_path, 9)
    fields = json.loads(record.read_text())
    data = record.with_suffix(".pt")
    torch.save({"not": "a checkpoint"}, data)
    raw = data.read_bytes()
    record.write_text(json.dumps({**fields, "size": len(raw), "crc32": zlib.crc32(raw)}))
    out = _run(tmp_path, 10, "close")
    assert "resumed (8, 'memory')" in out and "not a checkpoint a resume reads" in out, out
    assert _folder(tmp_path) == ["ckpt_00000005.pt", "ckpt_00000010.pt"]  # never ckpt_4294967296


def test_a_step_past_int64_is_never_recorded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    with dr.CheckpointManager(tmp_path / "run", model=torch.nn.Linear(2, 2)) as mgr:
        for step in (2**63, -1, True):
            with pytest.raises(dr.errors.UsageError, match=r"up to 2\*\*63-1|int64"):
                mgr.snapshot(step)
        mgr.snapshot(2**63 - 1)
        assert mgr._memory.newest is not None and mgr._memory.newest.step == 2**63 - 1
    assert list((tmp_path / "shm").iterdir()) == []


def test_a_store_name_taken_by_another_user_does_not_stop_snapshots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "shm").mkdir()
    (tmp_path / "theirs").mkdir()
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    squatted = place.store_dir(tmp_path / "run")  # the name the script's snapshots would take
    assert squatted is not None
    squatted.symlink_to(tmp_path / "theirs")  # made first by someone else (a symlink: never followed, never used)
    out = _run(tmp_path, 3, "die")
    assert "another user took its name" in out and out.count("another user took its name") == 1, out
    beside = [p for p in (tmp_path / "shm").iterdir() if p.name.startswith(f"{squatted.name}.")]
    assert len(beside) == 1 and len(list(beside[0].glob("state.*.json"))) == 2
    out = _run(tmp_path, 4, "close")  # a restart finds this user's directory beside the taken name
    assert "resumed (3, 'memory')" in out and "another user took its name" not in out, out
    assert squatted.is_symlink() and list((tmp_path / "theirs").iterdir()) == [] and not beside[0].exists()
