"""CheckpointManager, latest_checkpoint and resolve_checkpoint in one process (dist_resume/_folder.py)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.atomic import TEMP_NAME
from dist_resume._manager.manager import CheckpointManager
from dist_resume._source.consensus import resolve_checkpoint
from dist_resume._source.integrity import archive_digest, inspect_checkpoint
from dist_resume._source.listing import checkpoint_name, latest_checkpoint
from tests.helpers import flip_byte_in_tensor_record


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.fc2(model.fc1(torch.ones(3, 4))).sum().backward()
    opt.step()
    return model, opt


def _filled(step: int) -> Net:
    """A model whose every parameter equals ``step``: tells checkpoints apart after loading."""
    model = Net()
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
    return model


def _names(mgr: CheckpointManager) -> list[str]:
    return [p.name for p in mgr.checkpoints()]


def _save_steps(folder: Path, steps: list[int], keep_last: int = 10) -> CheckpointManager:
    mgr = CheckpointManager(folder, keep_last=keep_last)
    for step in steps:
        mgr.save(step, model=_filled(step))
    return mgr


def test_numbered_files_rotation_and_latest(tmp_path: Path) -> None:
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path / "ckpts", keep_last=2)
    assert mgr.checkpoints() == [] and mgr.latest() is None  # no folder yet: nothing, no error
    paths = [mgr.save(step, model=model, optimizer=opt, epoch=1) for step in (100, 200, 300)]
    assert [p.name for p in paths] == ["ckpt_00000100.pt", "ckpt_00000200.pt", "ckpt_00000300.pt"]
    assert _names(mgr) == ["ckpt_00000200.pt", "ckpt_00000300.pt"]
    assert mgr.latest() == paths[-1] == latest_checkpoint(tmp_path / "ckpts")
    info = inspect_checkpoint(paths[-1])
    assert (info.step, info.size) == (300, paths[-1].stat().st_size)
    assert "keep_last=2" in repr(mgr)


def test_steps_sort_numerically_past_the_padding(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [99_999_999, 100_000_000, 7])
    assert _names(mgr) == ["ckpt_00000007.pt", "ckpt_99999999.pt", "ckpt_100000000.pt"]
    assert mgr.latest() == tmp_path / "ckpt_100000000.pt"


def test_keep_last_one_keeps_only_the_new_checkpoint(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [1, 2, 3], keep_last=1)
    assert _names(mgr) == ["ckpt_00000003.pt"]


@pytest.mark.parametrize("keep_last", [0, -1, True, 1.5, "2", None])
def test_keep_last_is_validated_with_the_reason(tmp_path: Path, keep_last: object) -> None:
    with pytest.raises(ValueError, match="keep_last must be an int >= 1") as info:
        CheckpointManager(tmp_path, keep_last=keep_last)  # type: ignore[arg-type]
    assert "crash-safe" in str(info.value) and "fallback" in str(info.value)


@pytest.mark.parametrize("step", [-1, True, 1.0, None])
def test_bad_step_is_refused_before_anything_is_written(tmp_path: Path, step: object) -> None:
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        CheckpointManager(tmp_path / "c").save(step, model=Net())  # type: ignore[arg-type]
    assert not (tmp_path / "c").exists()


def test_failed_save_keeps_the_previous_checkpoints_and_rotates_nothing(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [1, 2], keep_last=2)
    before = {p.name: p.read_bytes() for p in mgr.checkpoints()}
    with pytest.raises(dr.errors.CheckpointWriteError, match="weights_only"):
        mgr.save(3, model=Net(), extra={"args": object()})
    assert {p.name: p.read_bytes() for p in mgr.checkpoints()} == before
    assert sorted(os.listdir(tmp_path)) == sorted([*before, ".dist_resume.lock"])  # and no temporary file


def test_latest_skips_damaged_and_foreign_files_and_logs_why(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = _save_steps(tmp_path, [100, 200, 300, 400, 500])
    p500, p400, p300 = (tmp_path / checkpoint_name(s) for s in (500, 400, 300))
    p500.write_bytes(p500.read_bytes()[: p500.stat().st_size // 2])  # truncated
    torch.save({"w": torch.ones(2)}, p400)  # a torch file without dist_resume metadata
    os.replace(tmp_path / checkpoint_name(100), p300)  # renamed by hand: metadata says step 100
    (tmp_path / "ckpt_00000600.pt").write_bytes(b"")  # empty
    caplog.clear()  # the save lines logged at INFO above
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert mgr.latest() == tmp_path / checkpoint_name(200)
    skipped = [r.getMessage() for r in caplog.records if r.name == "dist_resume"]
    assert len(skipped) == 4
    for name, reason in (
        ("ckpt_00000600.pt", "empty"),
        ("ckpt_00000500.pt", "truncated"),
        ("ckpt_00000400.pt", "dist_resume metadata"),
        ("ckpt_00000300.pt", "says step 100"),
    ):
        assert any(name in m and reason in m for m in skipped), (name, reason, skipped)


def test_verify_false_skips_only_the_crc_check(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [1, 2])
    newest = tmp_path / checkpoint_name(2)
    flip_byte_in_tensor_record(newest)
    assert mgr.latest(verify=True) == tmp_path / checkpoint_name(1)
    assert mgr.latest(verify=False) == newest  # the structure is intact; only the CRC check finds it


def test_temp_files_are_ignored_by_latest_and_only_ours_are_cleaned(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [1])
    ours = tmp_path / ".ckpt_00000002.pt.0123456789abcdef.tmp"  # what a killed save leaves
    ours.write_bytes(b"PK\x03\x04 partial")
    not_ours = [
        ".model.pt.0123456789abcdef.tmp",
        ".ckpt_00000002.pt.notrandomtoken.tmp",
        "x.tmp",
        "notes.txt",
        "ckpt_latest.pt",
    ]
    for name in not_ours:
        (tmp_path / name).write_bytes(b"keep me")
    assert TEMP_NAME.match(ours.name) and mgr.latest() == tmp_path / checkpoint_name(1)
    mgr.save(3, model=Net())
    assert not ours.exists()
    assert all((tmp_path / name).read_bytes() == b"keep me" for name in not_ours)


def test_saving_an_earlier_step_never_deletes_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mgr = _save_steps(tmp_path, [200], keep_last=1)
    caplog.clear()  # the save lines logged at INFO above
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        mgr.save(150, model=Net())
    assert _names(mgr) == ["ckpt_00000150.pt", "ckpt_00000200.pt"]
    assert any("later steps" in r.getMessage() for r in caplog.records)
    assert mgr.latest() == tmp_path / checkpoint_name(200)


def test_resaving_a_step_replaces_it_atomically(tmp_path: Path) -> None:
    mgr = _save_steps(tmp_path, [5])
    first = archive_digest(tmp_path / checkpoint_name(5))
    mgr.save(5, model=_filled(6))
    assert archive_digest(tmp_path / checkpoint_name(5)) != first and _names(mgr) == ["ckpt_00000005.pt"]


def test_checkpoint_mode_follows_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        path = _save_steps(tmp_path, [1]).latest()
    finally:
        os.umask(old)
    assert path is not None and stat.S_IMODE(path.stat().st_mode) == 0o640  # not mkstemp's 0o600


def test_resolve_file_is_returned_as_is(tmp_path: Path) -> None:
    for path in (tmp_path / "a.pt", tmp_path / "missing.pt"):
        assert resolve_checkpoint(path) == path
    (tmp_path / "a.pt").write_bytes(b"anything")
    assert resolve_checkpoint(str(tmp_path / "a.pt")) == tmp_path / "a.pt"


def test_resolve_folder_picks_the_latest_valid(tmp_path: Path) -> None:
    _save_steps(tmp_path, [10, 20])
    (tmp_path / checkpoint_name(30)).write_bytes(b"PK\x03\x04 torn")
    assert resolve_checkpoint(tmp_path) == tmp_path / checkpoint_name(20)


def test_resolve_empty_folder_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(dr.errors.CheckpointNotFoundError, match="is empty") as info:
        resolve_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value) and "start from scratch" in str(info.value)
    (tmp_path / "model.pt").write_bytes(b"x")
    with pytest.raises(dr.errors.CheckpointNotFoundError, match=r"model\.pt"):
        resolve_checkpoint(tmp_path)


def test_resolve_folder_of_broken_checkpoints_is_corrupt_not_not_found(tmp_path: Path) -> None:
    (tmp_path / checkpoint_name(1)).write_bytes(b"")
    (tmp_path / checkpoint_name(2)).write_bytes(b"PK\x03\x04 torn")
    with pytest.raises(dr.errors.CheckpointCorruptError) as info:
        resolve_checkpoint(tmp_path)
    assert not isinstance(info.value, dr.errors.CheckpointNotFoundError)  # "start from scratch" must not catch it
    msg = str(info.value)
    assert str(tmp_path) in msg and "ckpt_00000001.pt" in msg and "ckpt_00000002.pt" in msg
    assert "none is complete" in msg and "restore a good checkpoint" in msg


def test_resume_from_a_folder(tmp_path: Path) -> None:
    model, opt = _trained()
    mgr = CheckpointManager(tmp_path, keep_last=3)
    mgr.save(1, model=model, optimizer=opt)
    mgr.save(2, model=_filled(2))
    (tmp_path / checkpoint_name(3)).write_bytes(b"PK\x03\x04 torn")
    target = _filled(0)
    result = dr.resume(tmp_path, model=target, options=dr.ResumeOptions(verify=True))
    assert result.step == 2 and result.path == tmp_path / checkpoint_name(2)
    assert all(torch.all(p == 2) for p in target.parameters())


# ---------------------------------------------------------------- rotation counts only valid checkpoints


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "dist_resume" and r.levelno >= logging.WARNING]


def test_damaged_higher_steps_take_no_slot_and_are_named_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The issue's scenario: valid 100 and 200, an empty 400 and a truncated 500; a resume picks 200 and the
    next save (300, keep_last=2) keeps 300 and its valid fallback 200, leaves the damaged files alone and names
    each once; latest(), the warning and `dist-resume list` agree on the pick."""
    from dist_resume.cli._list import list_folder

    _save_steps(tmp_path, [100, 200], keep_last=2).close()
    (tmp_path / checkpoint_name(400)).write_bytes(b"")
    good = (tmp_path / checkpoint_name(200)).read_bytes()
    (tmp_path / checkpoint_name(500)).write_bytes(good[: len(good) // 2])
    model = _filled(0)
    mgr = CheckpointManager(tmp_path, keep_last=2)
    assert mgr.resume(model=model).step == 200  # type: ignore[union-attr]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        mgr.save(300, model=_filled(300))
    assert _names(mgr) == [checkpoint_name(s) for s in (200, 300, 400, 500)]  # 100 rotated out, nothing else
    warnings = _warnings(caplog)
    assert len(warnings) == 1, warnings
    (message,) = warnings
    assert "2 damaged checkpoint file(s)" in message and "pick ckpt_00000300.pt" in message
    assert message.count("ckpt_00000400.pt") == 1 and message.count("ckpt_00000500.pt") == 1
    assert "empty" in message and "truncated" in message
    assert "later steps" not in message
    assert mgr.latest() == tmp_path / checkpoint_name(300)
    assert list_folder(tmp_path)["pick"] == checkpoint_name(300)
    # the next save names them again, in one warning, and still keeps two valid checkpoints
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        mgr.save(310, model=_filled(310))
    assert len(_warnings(caplog)) == 1
    assert _names(mgr) == [checkpoint_name(s) for s in (300, 310, 400, 500)]
    mgr.close()


def test_a_valid_later_step_is_what_the_warning_names_and_latest_picks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Later valid steps take the newest slots (latest() picks them), a later file whose tensor data fails its CRC
    is damaged (latest() skips it), and the message says which one latest() and `dist-resume list` pick."""
    from dist_resume.cli._list import list_folder

    mgr = _save_steps(tmp_path, [100, 400, 500], keep_last=3)
    flip_byte_in_tensor_record(tmp_path / checkpoint_name(500))
    caplog.clear()  # the save lines logged at INFO above
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        mgr.save(300, model=_filled(300))
    later, damaged = _warnings(caplog)
    assert "later steps ['ckpt_00000400.pt']" in later and "will pick ckpt_00000400.pt" in later
    assert "1 damaged" in damaged and "ckpt_00000500.pt" in damaged and "CRC" in damaged
    assert "pick ckpt_00000400.pt" in damaged
    # keep_last=3 valid: 400, 300 (new), 100; the damaged 500 takes no slot
    assert _names(mgr) == [checkpoint_name(s) for s in (100, 300, 400, 500)]
    assert mgr.latest() == tmp_path / checkpoint_name(400) == tmp_path / list_folder(tmp_path)["pick"]
    mgr.close()


def test_a_file_checked_once_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rotation reads each checkpoint once in its life (the new one right after its write, with every CRC-32); a
    file changed since is read again."""
    from dist_resume._source import listing

    mgr = _save_steps(tmp_path, [1, 2, 3], keep_last=3)
    calls: list[tuple[str, bool]] = []
    real = listing.inspect_checkpoint  # type: ignore[attr-defined]  # the name listing imported (patched there)

    def recording(p: Path, verify: bool = True) -> Any:
        calls.append((p.name, verify))
        return real(p, verify=verify)

    monkeypatch.setattr(listing, "inspect_checkpoint", recording)
    mgr.save(4, model=_filled(4))
    assert calls == [(checkpoint_name(4), True)]  # the new file, read back once; every older one is known
    (tmp_path / checkpoint_name(3)).write_bytes((tmp_path / checkpoint_name(3)).read_bytes())  # rewritten by hand
    os.utime(tmp_path / checkpoint_name(3), ns=(1, 1))
    calls.clear()
    mgr.save(5, model=_filled(5))
    assert calls == [(checkpoint_name(5), True), (checkpoint_name(3), True)]  # kept: so every CRC-32 is checked
    assert dr.tools.latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(5) and len(calls) == 2  # known
    mgr.close()


def test_what_another_collective_sent_is_no_view_of_a_source(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # rank 0 resumes while rank 1 is in another collective (a save): the gather returns what that one sent
    from dist_resume._source import consensus

    path = dr.save_checkpoint(tmp_path / "a.pt", model=torch.nn.Linear(2, 2))
    for junk in ([{"op": "save"}, {"op": "save"}], [("a checkpoint file", "a.pt", None), b"\x00"]):
        monkeypatch.setattr(consensus, "all_gather_objects", lambda obj, junk=junk: junk)
        with pytest.raises(dr.errors.CheckpointConsensusError, match="the ranks made different calls"):
            consensus._same_kind(path, consensus._FILE)
