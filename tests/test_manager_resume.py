"""CheckpointManager.resume in one process: continue, init_from, a clean first run, and what must raise."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.atomic import TEMP_NAME
from dist_resume._source.listing import checkpoint_name


def _model(value: float) -> nn.Linear:
    model = nn.Linear(3, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _trained(value: float, lr: float = 0.1) -> tuple[nn.Linear, torch.optim.Optimizer]:
    model = _model(value)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def test_first_run_returns_none_and_says_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = _model(1.0)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        assert dr.CheckpointManager(tmp_path / "run").resume(model=model) is None
    assert f"no checkpoint in {tmp_path / 'run'}: starting fresh" in caplog.text
    assert not (tmp_path / "run").exists()  # reading creates nothing
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_a_folder_with_only_temps_and_the_lock_is_a_first_run(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / f".{checkpoint_name(7)}.0123456789abcdef.tmp").write_bytes(b"PK torn")
    assert TEMP_NAME.match(f".{checkpoint_name(7)}.0123456789abcdef.tmp")
    (folder / ".dist_resume.lock").write_text("host 1")
    assert dr.CheckpointManager(folder).resume(model=_model(1.0)) is None


def test_resume_after_a_save_returns_the_step(tmp_path: Path) -> None:
    model, opt = _trained(2.0)
    mgr = dr.CheckpointManager(tmp_path / "run")
    assert mgr.resume(model=model, optimizer=opt) is None
    for step in (10, 20):
        mgr.save(step, model=_model(float(step)), optimizer=opt)
    target, target_opt = _trained(0.0)
    res = mgr.resume(model=target, optimizer=target_opt, init_from=tmp_path / "elsewhere.pt")  # init_from unused
    assert res is not None and res.step == 20 and res.path.name == checkpoint_name(20)
    assert all(torch.all(p == 20.0) for p in target.parameters())
    mgr.close()


def test_init_from_restores_model_and_optimizer_state_but_keeps_this_runs_hyperparameters(tmp_path: Path) -> None:
    source, source_opt = _trained(3.0, lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(source_opt, 5)
    dr.save_checkpoint(tmp_path / "pretrained.pt", model=source, optimizer=source_opt, scheduler=sched, step=50)
    model, opt = _trained(0.0, lr=0.7)
    own_sched = torch.optim.lr_scheduler.StepLR(opt, 5)
    res = dr.CheckpointManager(tmp_path / "run").resume(
        model=model, optimizer=opt, scheduler=own_sched, init_from=tmp_path / "pretrained.pt"
    )
    assert res is not None and (res.step, res.epoch) == (0, 0)  # a new run: the loop starts at 0
    assert res.metadata["step"] == 50 and res.path == tmp_path / "pretrained.pt"
    assert res.restored == ("model", "optimizer")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), source.parameters()))
    for p, q in zip(model.parameters(), source.parameters()):
        assert torch.equal(opt.state[p]["momentum_buffer"], source_opt.state[q]["momentum_buffer"])
    assert opt.param_groups[0]["lr"] == 0.7 and opt.param_groups[0]["initial_lr"] == 0.7
    assert own_sched.last_epoch == 0  # the scheduler is this run's


def test_init_from_a_folder_takes_its_newest_checkpoint(tmp_path: Path) -> None:
    with dr.CheckpointManager(tmp_path / "other") as other:
        for step in (1, 2):
            other.save(step, model=_model(float(step)))
    model = _model(0.0)
    res = dr.CheckpointManager(tmp_path / "run").resume(model=model, init_from=tmp_path / "other")
    assert res is not None and res.path.name == checkpoint_name(2) and res.restored == ("model",)
    assert all(torch.all(p == 2.0) for p in model.parameters())


def test_a_missing_init_from_raises_instead_of_starting_at_step_0(tmp_path: Path) -> None:
    model = _model(1.0)
    with pytest.raises(dr.CheckpointNotFoundError, match=r"init_from .*missing\.pt' does not exist"):
        dr.CheckpointManager(tmp_path / "run").resume(model=model, init_from=tmp_path / "missing.pt")
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_a_mistyped_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(dr.CheckpointNotFoundError, match="neither does its parent"):
        dr.CheckpointManager(tmp_path / "typo" / "run").resume(model=_model(1.0))


def test_a_file_given_as_the_folder_raises(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(dr.CheckpointNotFoundError, match="is a file, not a folder"):
        dr.CheckpointManager(tmp_path / "run").resume(model=_model(1.0))


def test_only_damaged_checkpoints_raise_even_with_init_from(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / checkpoint_name(9)).write_bytes(b"PK\x03\x04 torn")
    dr.save_checkpoint(tmp_path / "init.pt", model=_model(5.0), step=1)
    model = _model(1.0)
    with pytest.raises(dr.CheckpointCorruptError):
        dr.CheckpointManager(folder).resume(model=model, init_from=tmp_path / "init.pt")
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_resume_kwargs_reach_resume(tmp_path: Path) -> None:
    mgr = dr.CheckpointManager(tmp_path / "run")
    mgr.save(3, model=nn.Sequential(nn.Linear(3, 2)))
    bigger = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))  # one more layer: strict refuses, strict=False loads
    with pytest.raises(dr.KeyMismatchError):
        mgr.resume(model=bigger)
    res = mgr.resume(model=bigger, strict=False)
    assert res is not None and res.step == 3 and res.missing_keys == ["1.weight", "1.bias"]
    mgr.close()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"allow_mising": "scheduler"}, TypeError),
        ({"allow_missing": "schedular"}, dr.UsageError),
        ({"optimizer_hparams": "mine"}, dr.UsageError),
    ],
    ids=["unknown-keyword", "unknown-part", "bad-hparams"],
)
def test_a_mistyped_option_fails_on_the_first_run_not_after_the_first_preemption(
    tmp_path: Path, kwargs: dict[str, str], error: type[Exception]
) -> None:
    with pytest.raises(error):
        dr.CheckpointManager(tmp_path / "run").resume(model=_model(0.0), **kwargs)  # an empty folder: a first run


def test_init_from_logs_what_it_did(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    source, source_opt = _trained(3.0, lr=0.1)
    torch.save({"model": source.state_dict()}, tmp_path / "weights.pt")  # weights only
    model, opt = _trained(0.0, lr=0.7)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        res = dr.CheckpointManager(tmp_path / "run").resume(
            model=model, optimizer=opt, init_from=tmp_path / "weights.pt", allow_missing="optimizer"
        )
    assert res is not None and res.restored == ("model",) and res.skipped == ("optimizer",)
    assert "initialised model from" in caplog.text and "model and optimizer" not in caplog.text
    assert "the checkpoint's values replace" not in caplog.text  # init_from keeps this run's hyperparameters
    assert opt.param_groups[0]["lr"] == 0.7
