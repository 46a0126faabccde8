"""The boundary where untrusted structure is read (dist_resume._core.untrusted): a check that fails on a value it did
not foresee leaves as CheckpointCorruptError naming the file and the field, on every entry point, and a
CheckpointManager falls back to the previous checkpoint, as for any damaged one."""

from __future__ import annotations

import json

import pytest
import torch

import dist_resume
from dist_resume import tools
from dist_resume._core.untrusted import untrusted
from dist_resume._layout import layout
from dist_resume.errors import CheckpointCorruptError, NotACheckpointError, UsageError


class _Unshowable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("the damaged value's repr")


@pytest.mark.parametrize(
    ("raise_", "kind"),
    [
        (lambda: sorted([1, "a"]), "TypeError"),  # type: ignore[type-var]
        (lambda: bool(torch.ones(2)), "RuntimeError"),
        (lambda: float(10**400), "OverflowError"),
        (lambda: dict[str, int]()["step"], "KeyError"),
        (lambda: (_ for _ in ()).throw(_Unshowable()), "_Unshowable"),
    ],
)
def test_an_unforeseen_error_inside_the_boundary_is_the_typed_error_naming_file_and_field(raise_, kind):
    with pytest.raises(CheckpointCorruptError) as caught:
        with untrusted("checkpoint 'ckpt.pt'", "its scheduler state"):
            raise_()
    message = str(caught.value)
    assert message.startswith(f"checkpoint 'ckpt.pt': its scheduler state could not be checked ({kind}")
    assert "resume from another checkpoint" in message
    assert type(caught.value.__cause__).__name__ == kind


def test_a_typed_error_and_a_deep_nesting_keep_their_meaning():
    with pytest.raises(UsageError, match="mine"), untrusted("checkpoint 'a.pt'", "its layout"):
        raise UsageError("mine")
    with pytest.raises(CheckpointCorruptError, match="nested too deeply"), untrusted("checkpoint 'a.pt'", "its layout"):
        raise RecursionError


def _checkpoints(tmp_path):
    model = torch.nn.Linear(3, 2)
    manager = dist_resume.CheckpointManager(tmp_path / "run", model=model, keep_last=3)
    manager.save(1)
    manager.save(2)
    return model, tmp_path / "run"


def _validator_raises_on_step_2(monkeypatch):
    """The layout's check of this toolkit's files raising a raw error for step 2's file only: a check that did not
    foresee what it was given (the held-out probe's 'validator that itself raises')."""
    checked = layout._toolkit

    def failing(obj, source, part_keys):
        if obj["meta"]["step"] == 2:
            raise KeyError("a key the check assumed")
        return checked(obj, source, part_keys)

    monkeypatch.setattr(layout, "_toolkit", failing)


def test_a_check_that_raises_is_a_typed_error_on_every_entry_point(tmp_path, monkeypatch, capsys):
    model, folder = _checkpoints(tmp_path)
    newest = folder / "ckpt_00000002.pt"
    _validator_raises_on_step_2(monkeypatch)
    words = "its layout could not be checked (KeyError"
    with pytest.raises(CheckpointCorruptError, match=r"ckpt_00000002\.pt.*its layout could not be checked"):
        dist_resume.resume(newest, model=model)
    with pytest.raises(CheckpointCorruptError, match="KeyError"):
        dist_resume.load_checkpoint(newest, part_keys={"model": "model"})
    with pytest.raises(CheckpointCorruptError, match="KeyError"):
        tools.convert_checkpoint(newest, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    # the CLI (in this process, so the patch holds): one line on stderr, exit status 1, no traceback
    from dist_resume.cli import main

    assert main(["inspect", str(newest)]) != 0
    assert main(["verify", str(newest), str(folder / "ckpt_00000001.pt")]) != 0
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    # the manager falls back to the previous checkpoint, as for any checkpoint found damaged when read
    result = dist_resume.CheckpointManager(folder, model=model).resume()
    assert result is not None and result.step == 1


def test_a_tensor_where_the_format_marker_was_is_not_taken_for_this_toolkits_file(tmp_path):
    path = tmp_path / "odd.pt"
    torch.save({"format": torch.ones(2), "model": {"w": torch.ones(2)}}, path)
    parts = layout.split_checkpoint(torch.load(path, weights_only=True), "checkpoint 'odd.pt'")
    assert parts.layout is not layout.Layout.TOOLKIT


def test_a_side_file_that_no_check_foresaw_is_the_typed_error(tmp_path):
    folder = tmp_path / "checkpoint-7"
    folder.mkdir()
    torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 7, "epoch": 1.5}))
    assert dist_resume.load_checkpoint(folder)["meta"]["step"] == 7
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 7, "epoch": 10**400}))
    loaded = dist_resume.load_checkpoint(folder)  # an epoch out of range is left out, not raised on
    assert loaded["meta"]["epoch"] is None


def test_a_manifest_the_parser_cannot_read_is_refused_by_name(tmp_path):
    from dist_resume._format.manifest import read_manifest

    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "manifest.json").write_text("[]")
    with pytest.raises((CheckpointCorruptError, NotACheckpointError), match=r"manifest\.json"):
        read_manifest(folder)


def test_a_part_check_that_raises_is_the_typed_error_naming_the_part(tmp_path, monkeypatch):
    from dist_resume._checkpoint.plan import restore_plan as plan

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    manager = dist_resume.CheckpointManager(tmp_path / "run", model=model, optimizer=opt, scheduler=sched)
    manager.save(1)
    manager.save(2)
    checked = plan.check_scheduler  # type: ignore[attr-defined]

    def failing(saved, live, source):
        if "ckpt_00000002" in source:
            return sorted([saved, 1])  # a check that did not foresee the value: TypeError
        return checked(saved, live, source)

    monkeypatch.setattr(plan, "check_scheduler", failing)  # the name plan_restore calls
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointCorruptError, match=r"ckpt_00000002\.pt.*its scheduler state could not be checked"):
        dist_resume.resume(tmp_path / "run" / "ckpt_00000002.pt", model=model, optimizer=opt, scheduler=sched)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # nothing changed
    result = manager.resume()  # the manager falls back to the previous checkpoint
    assert result is not None and result.step == 1
