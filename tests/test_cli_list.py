"""``dist-resume list``: checkpoints valid or damaged (and why), leftover temporary files, the pick, --json, --verify."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._source.listing import checkpoint_name, sharded_checkpoint_name
from dist_resume.cli import main

TEMP = f".{checkpoint_name(40)}.0123456789abcdef.tmp"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["list", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _folder(root: Path) -> Path:
    """ckpt 10, 20 valid; ckpt 30 truncated; a temporary file of an interrupted save of step 40; the lock file."""
    folder = root / "ckpts"
    with dr.CheckpointManager(folder, keep_last=5) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, model=nn.Linear(4, 4), epoch=step // 10)
    data = (folder / checkpoint_name(30)).read_bytes()
    (folder / checkpoint_name(30)).write_bytes(data[: len(data) // 2])
    (folder / TEMP).write_bytes(data[:100])
    return folder


def _flip_tensor_byte(path: Path) -> None:
    """Flip one byte inside a tensor record's data: the zip structure stays intact, its CRC-32 no longer matches."""
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size > 0)
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    raw[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_the_table_shows_damage_with_its_reason_the_temp_file_and_the_pick(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path)
    code, out, err = _run(capsys, str(folder))
    assert code == 0 and not err
    lines = out.splitlines()
    assert "3 checkpoint(s), 1 temporary file(s)" in lines[0]
    row10 = next(line for line in lines if line.strip().startswith(checkpoint_name(10)))
    assert row10.split()[1:3] == ["10", "1"] and row10.rstrip().endswith("valid")
    row30 = next(line for line in lines if line.strip().startswith(checkpoint_name(30)))
    assert "DAMAGED: CheckpointCorruptError" in row30
    assert TEMP in out and ".dist_resume.lock" not in out
    assert lines[-1] == f"resume would pick: {checkpoint_name(20)} (step 20)"


def test_json_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _folder(tmp_path)
    code, out, _ = _run(capsys, str(folder), "--json")
    report: dict[str, Any] = json.loads(out)
    assert code == 0
    assert report["schema"] == "dist-resume/list/1" and report["kind"] == "checkpoint-manager"
    assert report["verified"] is False and report["pick"] == checkpoint_name(20)
    assert [c["name"] for c in report["checkpoints"]] == [checkpoint_name(s) for s in (10, 20, 30)]
    first = report["checkpoints"][0]
    assert set(first) == {"name", "step", "epoch", "world_size", "bytes", "age_seconds", "status", "reason", "shards"}
    assert (first["step"], first["epoch"], first["world_size"], first["status"]) == (10, 1, 1, "valid")
    assert first["bytes"] == (folder / checkpoint_name(10)).stat().st_size
    assert report["checkpoints"][2]["status"] == "damaged" and report["checkpoints"][2]["reason"]
    assert [t["name"] for t in report["temporary_files"]] == [TEMP]


def test_verify_catches_a_flipped_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _folder(tmp_path)
    _flip_tensor_byte(folder / checkpoint_name(20))
    assert torch.load(folder / checkpoint_name(20), weights_only=True)  # torch.load itself does not notice
    code, out, _ = _run(capsys, str(folder), "--json", "--verify")
    report = json.loads(out)
    assert code == 0 and report["verified"] is True
    assert report["checkpoints"][1]["status"] == "damaged" and "CRC" in report["checkpoints"][1]["reason"]
    assert report["pick"] == checkpoint_name(10)
    assert dr.tools.latest_checkpoint(folder) == folder / checkpoint_name(10)  # the pick is resume's


def test_the_pick_is_resumes_even_without_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # resume CRC-checks the newest checkpoints before it picks; list must not name one resume would skip
    folder = _folder(tmp_path)
    (folder / checkpoint_name(30)).unlink()
    _flip_tensor_byte(folder / checkpoint_name(20))
    _, out, _ = _run(capsys, str(folder), "--json")
    report = json.loads(out)
    assert report["verified"] is False and report["pick"] == checkpoint_name(10)
    assert report["checkpoints"][1]["status"] == "damaged" and "CRC" in report["checkpoints"][1]["reason"]
    result = dr.CheckpointManager(folder).resume(model=nn.Linear(4, 4))
    assert result is not None and result.path.name == report["pick"]


def test_a_symlink_loop_named_as_a_checkpoint_is_listed_as_damaged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _folder(tmp_path)
    loop = folder / sharded_checkpoint_name(40)
    loop.symlink_to(loop.name)  # itself: every stat() of it is ELOOP
    code, out, _ = _run(capsys, str(folder), "--json")
    report = json.loads(out)
    assert code == 0 and report["pick"] == checkpoint_name(20)
    assert [c["status"] for c in report["checkpoints"] if c["name"] == loop.name] == ["damaged"]


def test_a_folder_whose_checkpoints_are_all_damaged_says_resume_raises(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / checkpoint_name(9)).write_bytes(b"PK\x03\x04 torn")
    code, out, _ = _run(capsys, str(tmp_path))
    assert code == 0 and "DAMAGED" in out and "resume raises CheckpointCorruptError" in out


def test_empty_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, str(tmp_path))
    assert code == 0
    assert "0 checkpoint(s)" in out and "resume would pick: nothing (no checkpoint" in out
    code, out, _ = _run(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    assert (report["kind"], report["checkpoints"], report["pick"]) == ("empty", [], None)


def test_a_missing_folder_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, str(tmp_path / "nope"))
    assert code == 2 and not out
    assert f"dist-resume list: error: folder '{tmp_path / 'nope'}' does not exist" in err and "hint:" in err


def test_a_file_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dr.save_checkpoint(tmp_path / "one.pt", model=nn.Linear(2, 2), step=1)
    code, _, err = _run(capsys, str(tmp_path / "one.pt"))
    assert code == 2 and "is a file, not a folder" in err and "dist-resume inspect" in err


def test_an_hf_trainer_output_folder_lists_each_checkpoint_with_its_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for n, step in ((500, 500), (1000, 1000), (1500, None)):
        sub = tmp_path / f"checkpoint-{n}"
        sub.mkdir()
        if step is not None:
            (sub / "trainer_state.json").write_text(json.dumps({"global_step": step, "epoch": step / 500}))
            (sub / "model.safetensors").write_bytes(b"weights")
    code, out, _ = _run(capsys, str(tmp_path), "--json")
    report = json.loads(out)
    assert code == 0 and report["kind"] == "hf-trainer-output"
    assert [(c["name"], c["step"], c["status"]) for c in report["checkpoints"]] == [
        ("checkpoint-500/", 500, "valid"),
        ("checkpoint-1000/", 1000, "valid"),
        ("checkpoint-1500/", 1500, "damaged"),  # an empty folder: a save that never finished
    ]
    assert report["pick"] == "checkpoint-1000/"
    _, out, _ = _run(capsys, str(tmp_path))
    assert (
        out.splitlines()[-1] == f"newest complete: checkpoint-1000/ (step 1000): resume from {tmp_path}/checkpoint-1000"
    )


def test_a_folder_of_other_files_is_not_called_empty_and_lists_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "model_final.pt")
    (tmp_path / "notes.txt").write_text("hi")
    (tmp_path / ".dist_resume.id").write_text("0123")  # the folder's identity (snapshots): not listed
    code, out, _ = _run(capsys, str(tmp_path))
    assert code == 0
    assert "no checkpoints, 0 checkpoint(s)" in out.splitlines()[0] and "empty" not in out
    assert "other files (not listed as checkpoints): 'model_final.pt', 'notes.txt'" in out
    assert "pass a file to resume(path)" in out


def test_a_parent_of_checkpoint_folders_says_to_pass_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    inner = tmp_path / "dcp_step_5"
    inner.mkdir()
    (inner / ".metadata").write_bytes(b"x")
    (inner / "__0_0.distcp").write_bytes(b"x")
    _, out, _ = _run(capsys, str(tmp_path))
    assert "holds checkpoint folders one level down ('dcp_step_5/')" in out and "starts fresh" not in out


def test_a_remote_folder_lists_as_temporary_only_what_an_interrupted_save_left(
    mem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a store a killed upload leaves nothing visible: only a sharded folder without its manifest is a leftover;
    the lease (held here) is not listed, as the local lock file is not, and other objects are other files."""
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    with dr.CheckpointManager(mem, keep_last=5) as mgr:
        for step in (10, 20):
            mgr.save(step, model=nn.Linear(4, 4))
        fs.pipe_file(f"{mem}/notes.txt", b"hi")
        fs.pipe_file(f"{mem}/model.safetensors", b"not looked at")
        fs.pipe_file(f"{mem}/{sharded_checkpoint_name(30)}/__0_0.distcp", b"half a save")  # killed before its manifest
        code, out, err = _run(capsys, mem, "--json")
        assert code == 0 and not err
        report: dict[str, Any] = json.loads(out)
        assert [c["name"] for c in report["checkpoints"]] == [checkpoint_name(10), checkpoint_name(20)]
        assert [t["name"] for t in report["temporary_files"]] == [sharded_checkpoint_name(30)]
        assert report["other_files"] == ["model.safetensors", "notes.txt"]
        code, out, _ = _run(capsys, mem)
    assert code == 0 and "2 checkpoint(s), 1 temporary file(s)" in out.splitlines()[0]
    assert ".dist_resume.lease" not in out
    temps = out.split("temporary files left by interrupted saves", 1)[1].split("other files", 1)[0]
    assert sharded_checkpoint_name(30) in temps and checkpoint_name(10) not in temps and "notes.txt" not in temps
