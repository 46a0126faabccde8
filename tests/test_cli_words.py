"""What the dist-resume command says: inspect's facts and part keys, verify's differences in words, convert's summary."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume
from dist_resume.cli import main
from dist_resume.cli._common import ExitCode

Run = Callable[..., tuple[int, str, str]]
BAD_GRAMMAR = re.compile(r"\ba [AEIOaeio]\w")  # "a AdamW", "a optimizer", "a int"


@pytest.fixture
def run(capsys: pytest.CaptureFixture[str]) -> Run:
    def _run(*args: Any) -> tuple[int, str, str]:
        code = main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert not BAD_GRAMMAR.search(out + err), out + err
        return code, out, err

    return _run


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(x))


def _adam_after(steps: int) -> tuple[Net, torch.optim.Adam]:
    torch.manual_seed(0)
    net = Net()
    groups: list[dict[str, Any]] = [
        {"params": net.fc.parameters()},
        {"params": net.head.parameters(), "weight_decay": 0.25},
    ]
    opt = torch.optim.Adam(groups, lr=3e-3)
    for _ in range(steps):
        opt.zero_grad()
        net(torch.randn(5, 4)).sum().backward()
        opt.step()
    return net, opt


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Net, torch.optim.Adam, Path]:
    """A dist_resume file after 6 Adam steps (4 parameters: 4 step tensors), with RNG state and an epoch."""
    net, opt = _adam_after(6)
    path = dist_resume.save_checkpoint(tmp_path / "dr.pt", model=net, optimizer=opt, step=30, epoch=3)
    return net, opt, Path(path)


def test_inspect_says_step_tensors_hyperparameters_class_time_and_state(saved: Any, run: Run) -> None:
    _, _, path = saved
    code, out, _ = run("inspect", path)
    assert code == ExitCode.OK
    assert "step tensors: 4 (cpu)" in out and "step: " not in out
    assert "group 0: lr=0.003 " in out and "group 1: weight_decay=0.25 lr=0.003 " in out
    assert "betas=[0.9, 0.999]" in out
    assert "model        Net: 4 keys" in out
    assert re.search(r"saved        \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", out)
    assert "RNG: yes, sampler: no, EMA: no" in out
    assert "parts        model <- 'model', optimizer <- 'optimizer'" in out
    assert "meta         step=30 epoch=3" in out

    report = json.loads(run("inspect", path, "--json")[1])
    assert report["optimizer"]["step"]["count"] == 4
    assert [g["lr"] for g in report["optimizer"]["groups"]] == [3e-3, 3e-3]
    assert report["optimizer"]["groups"][1]["weight_decay"] == 0.25
    assert "params" not in report["optimizer"]["groups"][0] and "param_names" not in report["optimizer"]["groups"][0]
    assert report["model"]["class"] == "Net" and report["saved_at"].endswith(" UTC")
    assert report["rng"] is True and report["sampler"] is False and report["ema"] is None
    assert report["part_keys"] == {"model": "model", "optimizer": "optimizer"}
    assert report["optimizer"]["hyperparameters"]["lr"] == 3e-3  # the old key stays


def test_inspect_keeps_a_schedulers_initial_lr_out_of_the_optimizer(tmp_path: Path, run: Run) -> None:
    net, opt = _adam_after(1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)  # writes initial_lr into every group
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "plain.pt")  # no class saved
    report = json.loads(run("inspect", tmp_path / "plain.pt", "--json")[1])
    assert (report["optimizer"]["kind"], report["optimizer"]["kind_from"]) == ("Adam", "hyperparameters")
    assert "initial_lr" not in report["optimizer"]["hyperparameters"] and sched.base_lrs == [3e-3, 3e-3]


def test_inspect_six_step_tensors_are_not_step_six(tmp_path: Path, run: Run) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(1, 2)).sum().backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 30}, tmp_path / "a.pt")
    out = run("inspect", tmp_path / "a.pt")[1]
    assert "step tensors: 6 (cpu), one per parameter" in out and "step: 6" not in out
    assert "model        6 keys" in out  # no class recorded in a plain torch.save file


def test_inspect_ema_presence_and_key_count(tmp_path: Path, run: Run) -> None:
    net, _ = _adam_after(0)
    ema = {k: v.clone() for k, v in net.state_dict().items()}
    torch.save({"model": net.state_dict(), "model_ema": ema}, tmp_path / "e.pt")
    code, out, _ = run("inspect", tmp_path / "e.pt")
    assert code == 0 and "EMA: yes (4 keys)" in out and "ema <- 'model_ema'" in out
    assert json.loads(run("inspect", tmp_path / "e.pt", "--json")[1])["ema"] == {"keys": 4}


def _tutorial(path: Path, net: nn.Module, epochs_run: int = 3) -> Path:
    """PyTorch's multigpu_torchrun.py snapshot."""
    torch.save({"MODEL_STATE": net.state_dict(), "EPOCHS_RUN": epochs_run}, path)
    return path


def test_inspect_names_the_key_each_part_came_from_and_part_overrides(tmp_path: Path, run: Run) -> None:
    net, _ = _adam_after(1)
    path = _tutorial(tmp_path / "snapshot.pt", net)
    code, out, _ = run("inspect", path)
    assert code == 0 and "parts        model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'" in out
    assert "other keys" not in out  # EPOCHS_RUN is the epoch, not an unknown key

    torch.save({"a": net.state_dict(), "b": {k: v + 1 for k, v in net.state_dict().items()}}, tmp_path / "two.pt")
    code, out, _ = run("inspect", tmp_path / "two.pt")
    assert code == 0 and "entries that could each be the model" in out  # ambiguous: a warning, no guess
    code, out, _ = run("inspect", tmp_path / "two.pt", "--part", "model=b", "--json")
    assert code == 0 and json.loads(out)["part_keys"] == {"model": "b"}


@pytest.mark.parametrize(
    "part, says",
    [
        ("model=NOPE", "'NOPE' for the model, but"),
        ("modl=MODEL_STATE", "unknown part(s) 'modl'"),
        ("MODEL_STATE", "is not PART=KEY"),
        ("model=", "is not PART=KEY"),
    ],
)
def test_a_bad_part_is_a_usage_error(tmp_path: Path, run: Run, part: str, says: str) -> None:
    net, _ = _adam_after(0)
    path = _tutorial(tmp_path / "snapshot.pt", net)
    code, out, err = run("inspect", path, "--part", part)
    assert code == ExitCode.INPUT and out == "" and says in err and "\nhint: " in err
    code, _, err = run("verify", path, path, "--part", part)
    assert code == ExitCode.INPUT and says.split("'")[0] in err


def test_verify_tutorial_snapshot_equals_dist_resume_file_of_the_same_state(
    saved: Any, tmp_path: Path, run: Run
) -> None:
    net, _, path = saved
    snapshot = _tutorial(tmp_path / "snapshot.pt", nn.DataParallel(net).module)
    code, out, _ = run("verify", snapshot, path)
    assert code == ExitCode.OK and out.startswith("equal: 4 model tensors compared")
    assert "A: detected, prefix none; model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'" in out
    assert "not compared: optimizer (only B has one), step (only B has one)" in out

    ddp_keys = {"module." + k: v for k, v in net.state_dict().items()}  # one naming scheme: canonical keys
    torch.save({"MODEL_STATE": ddp_keys, "EPOCHS_RUN": 3}, tmp_path / "ddp.pt")
    report = json.loads(run("verify", path, tmp_path / "ddp.pt", "--json")[1])
    assert report["equal"] and report["b"]["part_keys"] == {"model": "MODEL_STATE", "epoch": "EPOCHS_RUN"}

    _tutorial(tmp_path / "later.pt", net, epochs_run=4)
    code, out, _ = run("verify", snapshot, tmp_path / "later.pt")
    assert code == ExitCode.DIFFERENT and "epoch: A int 3, B int 4" in out


def test_verify_names_the_extra_key_and_the_largest_difference(saved: Any, tmp_path: Path, run: Run) -> None:
    net, opt, path = saved
    torch.optim.lr_scheduler.StepLR(opt, step_size=10)  # adds `initial_lr` to every group
    with torch.no_grad():
        net.head.bias[1] += 3.1e-4
    other = dist_resume.save_checkpoint(tmp_path / "b.pt", model=net, optimizer=opt, step=30, epoch=3)
    code, out, _ = run("verify", path, other)
    assert code == ExitCode.DIFFERENT
    assert "optimizer group 0: B has `initial_lr`, A does not" in out
    assert "optimizer group 1: B has `initial_lr`, A does not" in out
    assert re.search(r"model head\.bias: values differ \(max \|a-b\| = 3\.\de-04\)", out)
    assert "keys [" not in out and "vs [" not in out  # no dumped key lists

    report = json.loads(run("verify", other, path, "--json")[1])
    assert {"part": "optimizer", "key": "group 0", "problem": "A has `initial_lr`, B does not"} in report["differences"]


def test_verify_optimizer_state_by_parameter_name(tmp_path: Path, run: Run) -> None:
    net, opt = _adam_after(2)
    sd = opt.state_dict()
    a = dist_resume.save_checkpoint(tmp_path / "a.pt", model=net, optimizer=opt)
    sd["state"][2]["exp_avg"] = sd["state"][2]["exp_avg"] + 0.5
    opt.load_state_dict(sd)
    b = dist_resume.save_checkpoint(tmp_path / "b.pt", model=net, optimizer=opt)
    code, out, _ = run("verify", a, b)
    assert code == ExitCode.DIFFERENT
    assert "optimizer head.weight exp_avg: values differ (max |a-b| = 5.0e-01)" in out
    assert "state[" not in out and "param 2" not in out


def test_verify_part_applies_to_the_file_that_holds_the_key(tmp_path: Path, run: Run) -> None:
    net, _ = _adam_after(0)
    sd = net.state_dict()
    torch.save({"net": sd, "shadow": {k: v * 2 for k, v in sd.items()}}, tmp_path / "a.pt")
    torch.save(sd, tmp_path / "b.pt")
    assert run("verify", tmp_path / "a.pt", tmp_path / "b.pt")[0] == ExitCode.INPUT  # ambiguous without --part
    code, out, _ = run("verify", tmp_path / "a.pt", tmp_path / "b.pt", "--part", "model=net")
    assert code == ExitCode.OK, out
    code, out, _ = run("verify", tmp_path / "a.pt", tmp_path / "b.pt", "--part", "model=shadow")
    assert code == ExitCode.DIFFERENT and "values differ (max |a-b| = " in out


def test_convert_of_a_weights_only_file_says_nothing_about_an_optimizer(tmp_path: Path, run: Run) -> None:
    net, _ = _adam_after(0)
    opt = torch.optim.Adam(net.named_parameters())  # named: the optimizer state carries param_names
    torch.save(net.state_dict(), tmp_path / "w.pt")
    code, out, _ = run("convert", tmp_path / "w.pt", tmp_path / "ddp.pt", "--to", "ddp")
    assert code == 0 and "optimizer" not in out and "param_names" not in out
    torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "full.pt")
    code, out, _ = run("convert", tmp_path / "full.pt", tmp_path / "full_ddp.pt", "--to", "ddp")
    assert code == 0 and "optimizer param_names re-keyed (4)" in out


def test_library_messages_use_an_before_vowels(tmp_path: Path) -> None:
    net, _ = _adam_after(0)
    path = dist_resume.save_checkpoint(tmp_path / "a.pt", model=net, optimizer=torch.optim.AdamW(net.parameters()))
    with pytest.raises(dist_resume.DistResumeError, match="build an AdamW"):
        dist_resume.resume(path, model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    torch.save({"model": net.state_dict()}, tmp_path / "plain.pt")
    with pytest.raises(dist_resume.DistResumeError, match="but an optimizer was passed"):
        dist_resume.resume(tmp_path / "plain.pt", model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def test_hyperparameters_read_as_a_person_writes_them_and_close_floats_show_every_digit() -> None:
    from dist_resume.cli._compare import compare_values
    from dist_resume.cli.inspect._render import _group_line

    assert "lr=1e-06" in _group_line(0, {"lr": 1.0000000000000002e-06, "betas": (0.9, 0.999), "foreach": None})
    assert compare_values(1e-05, 1.0000000000000002e-06) == "A float 1e-05, B float 1e-06"
    close = compare_values(1e-06, 1.0000000000000002e-06)
    assert close is not None and "1.0000000000000002e-06" in close and "|a-b|" in close


def test_verify_names_optimizer_parameters_as_the_named_side_does(tmp_path: Path, run: Run) -> None:
    # A: a dist_resume file (param_names); B: a plain torch.save of the same state without names, one moment changed
    net, opt = _adam_after(2)
    a = dist_resume.save_checkpoint(tmp_path / "a.pt", model=net, optimizer=opt, step=2)
    osd = opt.state_dict()
    osd["state"][2]["exp_avg"] = osd["state"][2]["exp_avg"] + 1.0
    torch.save({"model": net.state_dict(), "optimizer": osd}, tmp_path / "b.pt")
    code, out, _ = run("verify", a, tmp_path / "b.pt")
    assert code == ExitCode.DIFFERENT
    assert "optimizer head.weight exp_avg" in out and "param 2" not in out


def test_verify_compares_expanded_tensors_by_what_they_store_never_each_element() -> None:
    """An expanded model entry (one stored value for every element): compared through its stored values, so ten
    billion elements cost nothing (materialised, they would need 40 GB); the kinds and the values still tell A
    from B."""
    from dist_resume.cli._compare import compare_values

    huge = 10**10
    assert compare_values(torch.zeros(1).expand(huge), torch.zeros(1).expand(huge)) is None
    assert (
        compare_values(torch.zeros(1).expand(huge), torch.ones(1).expand(huge)) == "values differ (max |a-b| = 1.0e+00)"
    )
    assert compare_values(torch.zeros(1).expand(3), torch.zeros(3)) == (
        "A an expanded tensor, its elements sharing memory, B a dense tensor"
    )
    rows = torch.arange(3.0).reshape(3, 1).expand(3, 4)
    assert compare_values(rows, torch.arange(3.0).reshape(1, 3).expand(4, 3).t()) is None  # the same, laid out apart
    assert compare_values(rows, torch.arange(4.0).reshape(1, 4).expand(3, 4)) == (
        "A and B are expanded differently: values not compared"
    )
