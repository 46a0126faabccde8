"""save_checkpoint_async and CheckpointManager.save_async (single process)."""

from __future__ import annotations

import pytest
import torch

import dist_resume
from dist_resume._save import async_save as _async


@pytest.fixture(autouse=True)
def _no_pending_between_tests():
    yield
    try:
        _async.wait_pending()
    except dist_resume.errors.CheckpointWriteError:
        pass


def _model_and_opt():
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    return model, opt


def test_the_file_holds_the_state_at_call_time_not_after(tmp_path):
    model, opt = _model_and_opt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    exp_avg = opt.state[model.weight]["exp_avg"].clone()
    handle = dist_resume.save_checkpoint_async(tmp_path / "a.pt", model=model, optimizer=opt, step=5)
    with torch.no_grad():  # training goes on at once, in place
        model.weight.add_(1.0)
        opt.state[model.weight]["exp_avg"].mul_(3.0)
    assert handle.wait() == tmp_path / "a.pt" and handle.done()
    saved = torch.load(tmp_path / "a.pt", weights_only=True)
    for key, value in before.items():
        assert torch.equal(saved["model"][key], value)
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], exp_avg)
    assert saved["meta"]["step"] == 5
    assert handle.wait() == tmp_path / "a.pt"  # later waits return the same outcome


def test_an_error_surfaces_on_wait_and_again_on_later_waits(tmp_path):
    model, _ = _model_and_opt()
    handle = dist_resume.save_checkpoint_async(tmp_path / "missing" / "a.pt", model=model)
    for _ in range(2):
        with pytest.raises(dist_resume.errors.CheckpointWriteError, match="does not exist"):
            handle.wait()
    assert not (tmp_path / "missing").exists()


def test_an_error_nobody_waited_for_surfaces_on_the_next_save(tmp_path):
    model, _ = _model_and_opt()
    dist_resume.save_checkpoint_async(tmp_path / "missing" / "a.pt", model=model)
    with pytest.raises(dist_resume.errors.CheckpointWriteError, match="missing"):
        dist_resume.save_checkpoint_async(tmp_path / "b.pt", model=model)
    assert not (tmp_path / "b.pt").exists()  # the failed call wrote nothing
    dist_resume.save_checkpoint_async(tmp_path / "b.pt", model=model).wait()  # the error was reported once
    assert (tmp_path / "b.pt").exists()


def test_the_next_save_waits_for_the_previous_one(tmp_path):
    model, _ = _model_and_opt()
    first = dist_resume.save_checkpoint_async(tmp_path / "a.pt", model=model, step=1)
    dist_resume.save_checkpoint_async(tmp_path / "b.pt", model=model, step=2).wait()
    assert first.done() and (tmp_path / "a.pt").exists()


def test_manager_save_async_rotates_only_after_the_write(tmp_path):
    model, opt = _model_and_opt()
    manager = dist_resume.CheckpointManager(tmp_path / "ckpts", keep_last=1)
    for step in (10, 20, 30):
        handle = manager.save_async(step, model=model, optimizer=opt)
    assert handle.wait().name == "ckpt_00000030.pt"
    assert [p.name for p in manager.checkpoints()] == ["ckpt_00000030.pt"]
    assert not [p for p in (tmp_path / "ckpts").iterdir() if p.name.endswith(".tmp")]
    fresh = torch.nn.Linear(64, 32)
    fresh_opt = torch.optim.Adam(fresh.parameters())
    assert dist_resume.resume(tmp_path / "ckpts", model=fresh, optimizer=fresh_opt).step == 30
    assert torch.equal(fresh.weight, model.weight)
