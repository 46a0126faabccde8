"""``dist-resume inspect`` warns about optimizer state that fits no parameter, saying what resume does with it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume
from dist_resume.cli import main


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _save(tmp_path: Path, rekey: Any) -> tuple[Path, nn.Module, dict[str, Any]]:
    model, opt = _trained()
    osd = opt.state_dict()
    osd = {"state": {rekey(k): v for k, v in osd["state"].items()}, "param_groups": osd["param_groups"]}
    path = tmp_path / "plain.pt"
    torch.save({"model": model.state_dict(), "optimizer": osd}, path)
    return path, model, osd


def _warnings(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[str], str]:
    assert main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(["inspect", str(path)]) == 0
    return report["warnings"], capsys.readouterr().out


def _fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def test_digit_string_keys_are_named_and_resume_reads_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _, saved = _save(tmp_path, str)  # what torch's dcp_to_torch_save writes: '0'..'3', groups list ints
    warnings, text = _warnings(path, capsys)
    (warning,) = [w for w in warnings if "digit strings" in w]
    assert "'0', '1', '2' and 1 more" in warning and "dcp_to_torch_save" in warning
    assert "reads each digit string as the id it names" in warning
    assert "warning: optimizer state is keyed by digit strings" in text
    assert "4 params (4 with state)" in text
    model, opt = _fresh()  # the warning's promise holds: resume restores every entry
    dist_resume.resume(path, model=model, optimizer=opt)
    for i, p in enumerate(model.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], saved["state"][str(i)]["exp_avg"])


@pytest.mark.parametrize(
    "rekey, named",
    [
        (lambda k: str(k) if k == 1 else k, "'1'"),  # mixed: ambiguous, not normalised
        (lambda k: k + 10, "10, 11, 12, 13"),  # ids no group lists
    ],
    ids=["mixed-digit-strings", "foreign-ids"],
)
def test_state_that_fits_no_parameter_is_named_and_resume_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rekey: Any, named: str
) -> None:
    path, _, _ = _save(tmp_path, rekey)
    warnings, text = _warnings(path, capsys)
    (warning,) = [w for w in warnings if "fit no parameter" in w or "fits no parameter" in w]
    assert named in warning and "the groups list 0, 1, 2, 3" in warning
    assert "resume refuses this optimizer state with OptimizerStateMismatchError" in warning
    assert "warning: " in text and "no parameter of the saved param_groups" in text
    model, opt = _fresh()
    with pytest.raises(dist_resume.errors.OptimizerStateMismatchError):
        dist_resume.resume(path, model=model, optimizer=opt)


def test_state_keyed_by_the_groups_ids_gets_no_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path, _, _ = _save(tmp_path, lambda k: k)
    warnings, _ = _warnings(path, capsys)
    assert warnings == []
