"""CheckpointManager.resume in one process: continue, init_from, a clean first run, and what must raise."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.atomic import TEMP_NAME
from dist_resume._source.listing import checkpoint_name
from tests.helpers import dataset_of


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
        mgr = dr.CheckpointManager(tmp_path / "run", model=model)
        assert mgr.resume() is None
    assert f"no checkpoint in {tmp_path / 'run'}: starting fresh" in caplog.text
    # the run's writer holds the folder from its resume on: the folder holds the lock file, nothing else
    assert os.listdir(tmp_path / "run") == [".dist_resume.lock"]
    assert f"pid={os.getpid()}" in mgr.lock_path.read_text()
    mgr.close()
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
    rng_before = torch.get_rng_state()
    res = dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt, scheduler=own_sched).resume(
        init_from=tmp_path / "pretrained.pt"
    )
    assert torch.equal(torch.get_rng_state(), rng_before)  # the RNG streams are this run's too
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
    with pytest.raises(dr.errors.CheckpointNotFoundError, match=r"init_from .*missing\.pt' does not exist"):
        dr.CheckpointManager(tmp_path / "run").resume(model=model, init_from=tmp_path / "missing.pt")
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_a_mistyped_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(dr.errors.CheckpointNotFoundError, match="neither does its parent"):
        dr.CheckpointManager(tmp_path / "typo" / "run").resume(model=_model(1.0))


def test_a_file_given_as_the_folder_raises(tmp_path: Path) -> None:
    (tmp_path / "run").write_text("not a folder")
    with pytest.raises(dr.errors.NotACheckpointError, match="is a file, not a folder") as caught:
        dr.CheckpointManager(tmp_path / "run").resume(model=_model(1.0))
    assert not isinstance(caught.value, FileNotFoundError)  # code that catches it to start fresh must not swallow it


def test_only_damaged_checkpoints_raise_even_with_init_from(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / checkpoint_name(9)).write_bytes(b"PK\x03\x04 torn")
    dr.save_checkpoint(tmp_path / "init.pt", model=_model(5.0), step=1)
    model = _model(1.0)
    with pytest.raises(dr.errors.CheckpointCorruptError):
        dr.CheckpointManager(folder).resume(model=model, init_from=tmp_path / "init.pt")
    assert all(torch.all(p == 1.0) for p in model.parameters())


def test_options_reach_resume_per_call_or_registered(tmp_path: Path) -> None:
    mgr = dr.CheckpointManager(tmp_path / "run", model=nn.Sequential(nn.Linear(3, 2)))
    mgr.save(3)
    bigger = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))  # one more layer: strict refuses, strict=False loads
    with pytest.raises(dr.errors.KeyMismatchError):
        mgr.resume(model=bigger)
    res = mgr.resume(model=bigger, options=dr.ResumeOptions(strict=False))
    assert res is not None and res.step == 3 and res.missing_keys == ["1.weight", "1.bias"]
    mgr.close()
    lenient = dr.CheckpointManager(tmp_path / "run", model=bigger, options=dr.ResumeOptions(strict=False))
    res = lenient.resume()  # the manager's options are the default of its resume
    assert res is not None and res.missing_keys == ["1.weight", "1.bias"]
    with pytest.raises(dr.errors.KeyMismatchError):
        lenient.resume(options=dr.ResumeOptions())  # a call's options replace the manager's
    lenient.close()


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda mgr: mgr.resume(model=_model(0.0), allow_missing="scheduler"), r"got allow_missing=.*ResumeOptions\("),
        (lambda mgr: mgr.resume(options=dr.ResumeOptions(allow_missing="schedular")), "unknown parts"),
        (lambda mgr: mgr.resume(options=dr.ResumeOptions(optimizer_hparams="mine")), "'checkpoint', 'current'"),
        (lambda mgr: mgr.resume(options={"strict": False}), "not a dist_resume.ResumeOptions"),
        (lambda mgr: mgr.save(1, modle=_model(0.0)), "unknown keyword.*'modle'.*model, optimizer, scheduler"),
        (
            lambda mgr: dr.CheckpointManager(mgr.folder, optimiser=None),  # type: ignore[call-arg]  # the typo tested
            "unknown keyword.*'optimiser'",
        ),
    ],
    ids=["old-keyword", "unknown-part", "bad-hparams", "options-not-a-value", "save-typo", "register-typo"],
)
def test_a_mistyped_option_or_object_fails_on_the_first_run_not_after_the_first_preemption(
    tmp_path: Path, make: Any, match: str
) -> None:
    mgr = dr.CheckpointManager(tmp_path / "run", model=_model(0.0))  # an empty folder: a first run
    with pytest.raises(dr.errors.UsageError, match=match):
        make(mgr)
    assert not mgr.checkpoints()
    mgr.close()


def test_register_once_then_save_and_resume_take_only_what_changes(tmp_path: Path) -> None:
    model, opt = _trained(4.0)
    sampler = dr.ResumableDistributedSampler(range(8), num_replicas=1, rank=0, seed=3)
    loader = torch.utils.data.DataLoader(dataset_of(range(8)), batch_size=2, sampler=sampler)
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt, dataloader=loader) as mgr:
        assert mgr.resume() is None
        next(iter(loader))
        mgr.save(1, epoch=0)
        mgr.save(2, model=_model(9.0))  # one call's object replaces the registered one for that call
    saved = torch.load(tmp_path / "run" / checkpoint_name(1), weights_only=True)
    assert saved["sampler"]["consumed"] == 2 and "optimizer" in saved and saved["meta"]["epoch"] == 0
    target, target_opt = _trained(0.0)
    again = dr.CheckpointManager(tmp_path / "run", model=target, optimizer=target_opt, sampler=sampler)
    res = again.resume()
    assert res is not None and res.step == 2 and res.restored == ("model", "optimizer", "sampler", "rng")
    assert all(torch.all(p == 9.0) for p in target.parameters())
    res = again.resume(optimizer=None, sampler=None)  # None: not this time
    assert res is not None and res.restored == ("model", "rng")
    again.close()


def test_a_manager_without_a_model_or_with_two_data_positions_says_what_to_pass(tmp_path: Path) -> None:
    mgr = dr.CheckpointManager(tmp_path / "run")
    with pytest.raises(dr.errors.UsageError, match="has no model: none was registered and none was passed"):
        mgr.resume()
    with pytest.raises(dr.errors.UsageError, match="has no model"):
        mgr.save(1)
    mine = dr.ResumableDistributedSampler(range(8), num_replicas=1, rank=0)
    other = torch.utils.data.DataLoader(dataset_of(range(8)), sampler=dr.ResumableDistributedSampler(range(8), 1, 0))
    with pytest.raises(dr.errors.UsageError, match="dataloader= whose sampler is another object"):
        dr.CheckpointManager(tmp_path / "run", sampler=mine, dataloader=other)
    same = torch.utils.data.DataLoader(dataset_of(range(8)), sampler=mine)
    both = dr.CheckpointManager(tmp_path / "run", model=_model(1.0), sampler=mine, dataloader=same)
    assert both.save(1).exists()  # the loader's sampler is that sampler: one data position
    both.close()
    assert [p.name for p in mgr.checkpoints()] == [checkpoint_name(1)]


def test_init_from_a_weights_only_file_needs_only_the_model_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source, source_opt = _trained(3.0, lr=0.1)
    torch.save({"model": source.state_dict()}, tmp_path / "weights.pt")  # weights only: the usual fine-tune start
    model, opt = _trained(0.0, lr=0.7)
    opt_before = {k: v.clone() for st in opt.state.values() for k, v in st.items()}
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        res = dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt).resume(
            init_from=tmp_path / "weights.pt"
        )  # no allow_missing needed
    assert res is not None and res.restored == ("model",) and res.skipped == ("optimizer",)
    said = [r.getMessage() for r in caplog.records if "initialised" in r.getMessage()]
    assert len(said) == 1 and "initialised model from" in said[0] and "holds no optimizer state" in said[0]
    assert "model and optimizer" not in caplog.text
    assert "the checkpoint's values replace" not in caplog.text  # init_from keeps this run's hyperparameters
    assert opt.param_groups[0]["lr"] == 0.7
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), source.parameters()))
    after = {k: v for st in opt.state.values() for k, v in st.items()}
    assert after.keys() == opt_before.keys() and all(torch.equal(after[k], opt_before[k]) for k in after)


_MISTYPED = """
import sys, torch, dist_resume as dr
model = torch.nn.Linear(2, 2)
with dr.CheckpointManager(sys.argv[1] + "/exp-1", model=model) as mgr:
    mgr.save(300)
for name in ("exp1", "other"):  # a typo of the last component, and a name unlike any
    with dr.CheckpointManager(sys.argv[1] + "/" + name, model=model) as mgr:
        assert mgr.resume() is None
"""


def test_a_missing_folder_named_almost_like_one_with_checkpoints_is_said_at_warning(tmp_path):
    """A typo in the folder's last component would start from step 0; the sibling it meant is named, on stderr of a
    script that set up no logging (Python's last-resort handler prints WARNING)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "-c", _MISTYPED, str(tmp_path)], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "does not exist" in line]
    assert lines == [
        f"checkpoint folder {tmp_path / 'exp1'} does not exist, but {tmp_path / 'exp-1'} next to it holds checkpoints "
        f"(newest: ckpt_00000300.pt): if that is the run to continue, fix the path; starting fresh in {tmp_path / 'exp1'}"
    ], done.stderr
