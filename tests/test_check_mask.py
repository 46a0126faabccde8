"""dist-resume check compares what a run means, not where it ran: a saved string that names the run's own folder (a
script that saves its arguments, as nanoGPT's ``config`` or torchvision's ``args``) is compared with that folder
replaced by ``<run folder>``, and the report says so. Without launching a training run; the launch:
tests/test_check_cli.py (test_a_correct_script_resumes_exactly)."""

from __future__ import annotations

from pathlib import Path

import torch

import dist_resume as dr
from dist_resume._layout.layout import CheckpointParts, Layout
from dist_resume.cli.check._compare import compare_pair, pairs_to_compare
from dist_resume.cli.check._mask import CHECK_FOLDER, RUN_FOLDER, mask_parts, masked_said, masks_for
from tests.test_check_verdict import _verdict

STEPS = (2, 4, 6)


def test_every_string_naming_a_run_folder_is_masked_and_said(tmp_path: Path) -> None:
    ref, got = tmp_path / "reference", tmp_path / "interrupted"
    masks = masks_for((ref, got), tmp_path)
    weights = {"w": torch.ones(2)}
    extra = {
        "config": {"out_dir": str(ref), "lr": 0.1, "log": f"--log={ref}/train.log"},
        "args": [str(ref / "best.pt"), ("nested", str(ref))],
        "data": "/data/shards",  # names no run: left as it is
        "cache": str(tmp_path / "cache"),  # the check's folder, no run's
    }
    parts = CheckpointParts(Layout.TOOLKIT, weights, extra=extra, sampler={"path": str(ref)}, meta={"v": 1})
    masked, keys = mask_parts(parts, masks)
    assert masked.extra == {
        "config": {"out_dir": RUN_FOLDER, "lr": 0.1, "log": f"--log={RUN_FOLDER}/train.log"},
        "args": [f"{RUN_FOLDER}/best.pt", ("nested", RUN_FOLDER)],
        "data": "/data/shards",
        "cache": f"{CHECK_FOLDER}/cache",
    }
    assert masked.sampler == {"path": RUN_FOLDER} and parts.extra["config"]["out_dir"] == str(ref)  # a copy
    assert masked.model is weights and masked.meta is parts.meta  # what names no folder is not copied
    assert keys == (
        "extra ['config']['out_dir']",
        "extra ['config']['log']",
        "extra ['args'][0]",
        "extra ['args'][1][1]",
        f"{CHECK_FOLDER}extra ['cache']",
        "data position ['path']",
    )
    # the other run's folder: the same placeholder, so the two compare equal
    other, _ = mask_parts(CheckpointParts(Layout.TOOLKIT, weights, extra={"out": str(got)}), masks)
    assert other.extra == {"out": RUN_FOLDER}
    said = masked_said(keys)
    assert said.startswith("5 saved strings named the run's folder (extra ['config']['out_dir'], ")
    assert f"compared with it replaced by {RUN_FOLDER}" in said
    assert said.endswith(
        f"1 saved string named the check's temporary folder (extra ['cache']); compared with it "
        f"replaced by {CHECK_FOLDER}"
    )
    assert mask_parts(parts, ()) == (parts, ())


def _save_args(folder: Path, step: int) -> None:
    """A checkpoint that saves its script's arguments, its own folder among them, as nanoGPT's and torchvision's do."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    args = {"out_dir": str(folder), "resume": str(folder / "ckpt_latest.pt"), "lr": 0.1, "data": "shards"}
    dr.save_checkpoint(folder / f"ckpt_{step:08d}.pt", model=model, step=step, extra={"args": args})


def test_two_runs_saving_their_own_folder_compare_exact_with_a_note(tmp_path: Path) -> None:
    folders = (tmp_path / "reference", tmp_path / "interrupted")
    for folder in folders:
        folder.mkdir()
        for step in STEPS:
            _save_args(folder, step)
    (first, *_) = pairs_to_compare(*folders)
    unmasked = compare_pair(first)  # the comparison as it was: the folder is a difference
    assert [(p.part, p.key, p.problem[:30]) for p in unmasked.parts] == [
        ("extra", "-", "['args']: ['out_dir']: A str '")
    ]
    check = _verdict(tmp_path, folders, by_launch_1=(2,))
    assert check.exact and check.causes == () and check.diagnosis is None, check.report()
    (note,) = check.notes
    assert note == (
        "2 saved strings named the run's folder (extra ['args']['out_dir'], extra ['args']['resume']), another in "
        f"each run; compared with it replaced by {RUN_FOLDER}"
    )
    assert f"  note         {note}" in check.report() and check.as_dict()["notes"] == [note]
