"""What a newcomer hit (issue 35): a file given as the manager's folder, another run's ckpt.pt beside it, a failed
first start leaving a folder, advice spelled as the call is made, one statement per fact in `list`, and the demo's
log agreeing with its checkpoints."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume.cli import main
from dist_resume.errors import CheckpointNotFoundError, KeyMismatchError, NotACheckpointError

REPO = Path(__file__).resolve().parent.parent


def test_a_file_given_as_the_folder_is_no_file_not_found(tmp_path: Path) -> None:
    dr.save_checkpoint(tmp_path / "model.pt", model=nn.Linear(2, 2), step=3)
    mgr = dr.CheckpointManager(tmp_path / "model.pt", model=nn.Linear(2, 2))
    with pytest.raises(NotACheckpointError) as info:
        mgr.resume()
    assert not isinstance(info.value, FileNotFoundError)  # code starting fresh on FileNotFoundError must not eat it
    text = str(info.value)
    assert f"init_from={str(tmp_path / 'model.pt')!r}" in text
    assert f"dist-resume convert {tmp_path / 'model.pt'} --into NEW_FOLDER" in text


def test_a_folder_that_is_itself_a_checkpoint_gets_both_ways_out(tmp_path: Path) -> None:
    sharded = tmp_path / "hf" / "checkpoint-2"
    sharded.mkdir(parents=True)
    (sharded / "trainer_state.json").write_text('{"global_step": 2}')
    (sharded / "optimizer.pt").write_bytes(b"")
    (sharded / "model.safetensors").write_bytes(b"")
    with pytest.raises(NotACheckpointError) as info:
        dr.CheckpointManager(sharded, model=nn.Linear(2, 2)).resume()
    text = str(info.value)
    assert "it is itself a checkpoint" in text and f"init_from={str(sharded)!r}" in text
    assert f"dist-resume convert {sharded} --into NEW_FOLDER" in text


def test_another_runs_ckpt_pt_in_the_folder_is_named_before_a_fresh_start(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    torch.save({"model": nn.Linear(2, 2).state_dict(), "iter_num": 9}, out / "ckpt.pt")
    with caplog.at_level(logging.INFO, logger="dist_resume"), dr.CheckpointManager(out, model=nn.Linear(2, 2)) as m:
        assert m.resume() is None
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(out / "ckpt.pt") in warning
    assert (
        f"init_from={str(out / 'ckpt.pt')!r}" in warning
        and f"dist-resume convert {out / 'ckpt.pt'} --into {out}" in warning
    )

    with pytest.raises(NotACheckpointError) as info:  # init_from= the folder: the advice names the file to pass
        dr.CheckpointManager(tmp_path / "new", model=nn.Linear(2, 2)).resume(init_from=out)
    assert f"init_from={str(out / 'ckpt.pt')!r}" in str(info.value) and "resume()" not in str(info.value)
    assert not (tmp_path / "new").exists()


def test_an_empty_init_from_folder_says_init_from(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"init_from .* is a folder with no checkpoint in it") as info:
        dr.CheckpointManager(tmp_path / "new", model=nn.Linear(2, 2)).resume(init_from=tmp_path / "empty")
    assert "resume()" not in str(info.value)


@pytest.mark.parametrize("bad", ["missing", "garbage"])
def test_a_failed_init_from_leaves_no_new_folder(tmp_path: Path, bad: str) -> None:
    source = tmp_path / "init.pt"
    if bad == "garbage":
        source.write_bytes(b"not a checkpoint")
    folder = tmp_path / "run"
    mgr = dr.CheckpointManager(folder, model=nn.Linear(2, 2))
    with pytest.raises(dr.errors.CheckpointError):
        mgr.resume(init_from=source)
    assert not folder.exists()
    assert mgr.resume() is None and folder.is_dir()  # the next start takes the folder as usual
    mgr.close()


def test_a_failed_init_from_leaves_an_existing_folder_as_it_was(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointNotFoundError):
        dr.CheckpointManager(folder, model=nn.Linear(2, 2)).resume(init_from=tmp_path / "missing.pt")
    assert (folder / "notes.txt").read_text() == "mine"


def test_strict_advice_is_spelled_as_resume_takes_it(tmp_path: Path) -> None:
    dr.save_checkpoint(tmp_path / "small.pt", model=nn.Sequential(nn.Linear(2, 2)))
    bigger = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(KeyMismatchError) as info:
        dr.resume(tmp_path / "small.pt", model=bigger)
    assert "options=ResumeOptions(strict=False)" in str(info.value)


def test_no_message_says_pass_strict_false_alone() -> None:
    """Every "pass strict=False" in a message names ResumeOptions, the one place resume takes strict."""
    found = []
    for path in (REPO / "dist_resume").rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"pass strict=False", line):
                found.append(f"{path.relative_to(REPO)}:{number}")
    assert found == []


def test_list_says_a_damaged_checkpoint_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    with dr.CheckpointManager(tmp_path / "ck", model=nn.Linear(2, 2), keep_last=3) as mgr:
        mgr.save(10)
        newest = mgr.save(20)
    data = Path(newest).read_bytes()
    Path(newest).write_bytes(data[: len(data) // 2])
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        caplog.clear()
        assert main(["list", str(tmp_path / "ck")]) == 0
    out, err = capfd.readouterr()
    assert "DAMAGED" in out and "ckpt_00000020.pt" in out  # the row says it
    assert "ckpt_00000020.pt" not in err  # and nothing else does
    assert not [r for r in caplog.records if "ckpt_00000020.pt" in r.getMessage()]
    caplog.clear()
    assert dr.CheckpointManager(tmp_path / "ck").latest() is not None  # the library still warns when it skips one
    assert any("skipping checkpoint" in r.getMessage() for r in caplog.records)


def test_the_demo_logs_the_epoch_its_checkpoint_records(tmp_path: Path) -> None:
    # one process, 512 samples of 16: step 32 is the first epoch's last batch, saved there
    done = subprocess.run(
        [sys.executable, str(REPO / "launch" / "train.py"), "--ckpt-dir", str(tmp_path / "c"), "--steps", "32"]
        + ["--save-every", "32", "--log-every", "32"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    logged = re.search(r"train: step 32  epoch (\d+)", done.stdout)
    saved = re.search(r"saved .*ckpt_00000032\.pt \(step 32, epoch (\d+)", done.stdout)
    assert logged and saved, done.stdout
    assert logged.group(1) == saved.group(1) == "1"
    assert "(epoch 0 done)" in done.stdout
    assert torch.load(tmp_path / "c" / "ckpt_00000032.pt", weights_only=True)["meta"]["epoch"] == 1


def test_the_demos_folders_are_ignored() -> None:
    ignored = (REPO / ".gitignore").read_text().splitlines()
    assert "demo-ckpt/" in ignored and "demo-ckpt-reference/" in ignored
