"""Apply is all or nothing: a fault injected at every step of apply leaves every live object bitwise as it was.

Each case breaks one step for one call (after it changed what it changes, where it can): the objects' own
``load_state_dict``, torch's ``Optimizer.load_state_dict`` midway and in ``__setstate__``, a submodule's load
midway through the model and the EMA, a module's ``set_extra_state``, numpy's RNG setter after the Python and
torch streams were set. After each, ``resume`` raised ``RestoreError`` naming the part, chained to the fault.
"""

from __future__ import annotations

import copy
import dataclasses
import random
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._checkpoint.apply.transaction import STEPS
from dist_resume._checkpoint.objects import LiveObjects
from dist_resume._checkpoint.plan.restore_plan import plan_restore
from dist_resume._layout.layout import split_checkpoint
from dist_resume._source.open import load_checkpoint
from dist_resume.errors import DistResumeError, RestoreError
from tests.models import TinyNet, assert_same, make_batches, train_steps

BATCHES = make_batches(5)


class Tagged(nn.Module):
    """A module with extra state (``get_extra_state`` / ``set_extra_state``), as TransformerEngine's layers have."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = {"name": tag}

    def get_extra_state(self) -> Any:
        return self.tag

    def set_extra_state(self, state: Any) -> None:
        self.tag = dict(state)


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        self.net = TinyNet(seed)
        self.tagged = Tagged(f"run{seed}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _objects(seed: int) -> dict[str, Any]:
    model = Net(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    sampler = dr.ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0, seed=4)
    ema = torch.optim.swa_utils.AveragedModel(model)
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "dataloader": sampler, "ema": ema}


def _trained(seed: int, batches: list[Any], draws: int) -> dict[str, Any]:
    objs = _objects(seed)
    train_steps(objs["model"], objs["optimizer"], batches, scheduler=objs["scheduler"], scaler=objs["scaler"])
    objs["ema"].update_parameters(objs["model"])
    it = iter(objs["dataloader"])
    for _ in range(draws):
        next(it)
    return objs


@pytest.fixture
def ckpt(tmp_path):
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, step=3, **_trained(0, BATCHES[:3], draws=2))
    random.seed(11), torch.manual_seed(11), np.random.seed(11)  # streams unlike the saved ones
    return path


def _module_state(module: nn.Module) -> dict[str, Any]:
    return {
        k: v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v)
        for k, v in module.state_dict().items()
    }


def frozen(objs: dict[str, Any]) -> dict[str, Any]:
    """Everything resume may change, copied; the optimizer's state tensors by identity too."""
    opt = objs["optimizer"]
    np_state = cast(tuple[Any, ...], np.random.get_state())
    return {
        "model": _module_state(objs["model"]),
        "ema": _module_state(objs["ema"]),
        "optimizer": copy.deepcopy(opt.state_dict()),
        "optimizer_tensors": [id(t) for s in opt.state.values() for t in s.values()],
        "optimizer_groups": [id(g) for g in opt.param_groups],
        "scheduler": copy.deepcopy(objs["scheduler"].state_dict()),
        "scaler": objs["scaler"].state_dict(),
        "sampler": dict(vars(objs["dataloader"])),
        "rng": (
            torch.get_rng_state(),
            random.getstate(),
            np_state[0],
            torch.from_numpy(np_state[1].copy()),
            np_state[2:],
        ),
    }


def once(real: Callable[..., Any], *, first: bool = True, exc: Exception | None = None) -> Callable[..., Any]:
    """``real``, except that its first call raises ``exc`` (after running ``real`` when ``first``)."""
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        if calls:
            return real(*args, **kwargs)
        calls.append(1)
        if first:
            real(*args, **kwargs)
        raise exc or RuntimeError("injected fault")

    return broken


def _nth_call(n: int, real: Callable[..., Any]) -> Callable[..., Any]:
    """``real``, except that its ``n``-th call raises (once)."""
    calls: list[int] = []

    def broken(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == n:
            raise RuntimeError("injected fault midway")
        return real(*args, **kwargs)

    return broken


def _on(attr: str, name: str = "load_state_dict", **kw: Any) -> Callable[[Any, dict[str, Any]], None]:
    def inject(monkeypatch: Any, objs: dict[str, Any]) -> None:
        obj = objs[attr] if "." not in attr else objs[attr.split(".")[0]].get_submodule(attr.split(".", 1)[1])
        if isinstance(obj, nn.Module):  # on the instance: its __dict__ is no part of its state
            monkeypatch.setattr(obj, name, once(getattr(obj, name), **kw))
        else:  # on the class: a scheduler's state_dict() is its __dict__
            monkeypatch.setattr(type(obj), name, once(getattr(type(obj), name), **kw))

    return inject


def _inside_torch_optimizer(monkeypatch: Any, objs: dict[str, Any]) -> None:
    real = torch.optim.Optimizer._process_value_according_to_param_policy
    monkeypatch.setattr(
        torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(_nth_call(5, real))
    )


def _in_setstate(monkeypatch: Any, objs: dict[str, Any]) -> None:
    """The issue's case: torch's Adam.__setstate__ raising KeyError('step') after the state was replaced."""
    monkeypatch.setattr(torch.optim.AdamW, "__setstate__", once(torch.optim.AdamW.__setstate__, exc=KeyError("step")))


def _rng_setter(monkeypatch: Any, objs: dict[str, Any]) -> None:
    monkeypatch.setattr(np.random, "set_state", once(np.random.set_state))


CASES = {  # id: (the part the error names, how to break it)
    "scaler": ("scaler", _on("scaler")),
    "scheduler": ("scheduler", _on("scheduler")),
    "sampler": ("sampler", _on("dataloader")),
    "rng": ("rng", _rng_setter),
    "optimizer": ("optimizer", _on("optimizer")),
    "optimizer_torch_midway": ("optimizer", _inside_torch_optimizer),
    "optimizer_setstate": ("optimizer", _in_setstate),
    "model_midway": ("model", _on("model.net.head", "_load_from_state_dict", first=False)),
    "model_extra_state": ("model", _on("model.tagged", "set_extra_state")),
    "ema_midway": ("ema", _on("ema.module.net.bn", "_load_from_state_dict", first=False)),
}


def test_the_cases_cover_every_step_and_a_full_plan_runs_them_in_order(ckpt):
    assert {part for part, _ in CASES.values()} == set(STEPS)
    objs = _trained(6, BATCHES[3:5], draws=4)
    data = objs.pop("dataloader")
    plan = plan_restore(
        split_checkpoint(load_checkpoint(ckpt, mmap=False), "test"),
        LiveObjects(data=data, **objs),
        dr.ResumeOptions(),
    )
    assert [step.name for step in plan.steps()] == list(STEPS)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_fault_at_any_step_leaves_every_object_unchanged(ckpt, monkeypatch, case):
    part, inject = CASES[case]
    objs = _trained(6, BATCHES[3:5], draws=4)
    before = frozen(objs)
    inject(monkeypatch, objs)
    with pytest.raises(RestoreError) as info:
        dr.resume(ckpt, **objs)
    err = info.value
    assert isinstance(err, DistResumeError) and err.part == part
    assert f"the {part} failed" in str(err) and "as it was before" in str(err)
    assert "injected" in str(err.__cause__) or isinstance(err.__cause__, KeyError)
    assert_same(frozen(objs), before)
    assert objs["model"].tagged.tag == {"name": "run6"}
    monkeypatch.undo()
    dr.resume(ckpt, **objs)  # the same objects then resume as if nothing had happened
    assert objs["model"].tagged.tag == {"name": "run0"}


def test_a_successful_apply_writes_the_optimizer_state_into_its_existing_tensors(ckpt):
    objs = _trained(6, BATCHES[3:5], draws=4)
    opt = objs["optimizer"]
    tensors = {(id(p), k): t for p, s in opt.state.items() for k, t in s.items()}
    params = [id(p) for p in objs["model"].parameters()]
    result = dr.resume(ckpt, **objs)
    assert result.restored == ("model", "ema", "scaler", "optimizer", "scheduler", "sampler", "rng")
    assert {(id(p), k): t for p, s in opt.state.items() for k, t in s.items()} == tensors  # the same objects
    assert [id(p) for p in objs["model"].parameters()] == params
    saved = torch.load(ckpt, weights_only=True)
    assert_same(opt.state_dict()["state"], saved["optimizer"]["state"])
    assert objs["dataloader"].state_dict()["consumed"] == 2


def test_a_model_copy_is_kept_only_where_its_own_load_can_raise(ckpt):
    from dist_resume._checkpoint.apply.module_step import can_raise

    hooked = TinyNet(1)
    hooked.fc.register_load_state_dict_post_hook(lambda module, keys: None)
    assert [can_raise(m) for m in (TinyNet(0), torch.optim.swa_utils.AveragedModel(TinyNet(0)), Net(0), hooked)] == [
        False,
        False,
        True,  # Tagged's own set_extra_state
        True,
    ]
    parts = split_checkpoint(load_checkpoint(ckpt, mmap=False), "test")
    plain = TinyNet(6)
    plain_parts = dataclasses.replace(parts, model=Net(0).net.state_dict())
    plan = plan_restore(plain_parts, LiveObjects(plain), dr.ResumeOptions(rng=False))
    assert [s.name for s in plan.steps()] == []  # a plain model is written at the commit: no step, no copy
    net = Net(6)
    plan = plan_restore(parts, LiveObjects(net), dr.ResumeOptions(rng=False))
    (model_step,) = plan.steps()
    tensors, extras = model_step.save()  # Tagged's set_extra_state may raise: loaded as a step, with a copy
    assert len(tensors) == len(net.net.state_dict()) and extras == {"tagged": {"name": "run6"}}
    before = _module_state(plain)
    plan = plan_restore(plain_parts, LiveObjects(plain), dr.ResumeOptions(rng=False))
    plan.apply()
    assert not all(torch.equal(before[k], v) for k, v in plain.state_dict().items())


def _fault_in_copy(monkeypatch: Any, *, after: int) -> None:
    """``Tensor.copy_`` raises once, at its ``after``-th call from now (a device or I/O error while writing)."""
    real = torch.Tensor.copy_
    calls = [0]

    def copy_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == after:
            raise RuntimeError("injected fault in copy_")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)


@pytest.fixture
def plain_ckpt(tmp_path):
    """A plain model (written at the commit: no extra-state override) with AdamW state, and what it saved."""
    model = TinyNet(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, BATCHES[:3])
    path = dr.save_checkpoint(tmp_path / "plain.pt", model=model, optimizer=opt, step=3, rng=False)
    return path, torch.load(path, weights_only=True)


@pytest.mark.parametrize("after", [1, 12])
def test_a_fault_while_the_data_is_written_is_a_partial_restore_that_a_second_resume_repairs(
    plain_ckpt, monkeypatch, after
):
    """The commit writes in place with no copy kept: a fault there says so, and resuming again restores it whole."""
    path, saved = plain_ckpt
    model = TinyNet(6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, BATCHES[3:5])
    _fault_in_copy(monkeypatch, after=after)
    with pytest.raises(dr.errors.PartialRestoreError) as info:
        dr.resume(path, model=model, optimizer=opt)
    assert "resume from it again to restore it whole" in str(info.value) and "injected" in str(info.value.__cause__)
    assert isinstance(info.value, RestoreError) and info.value.part == "optimizer, model"
    monkeypatch.undo()
    dr.resume(path, model=model, optimizer=opt)
    assert_same(model.state_dict(), saved["model"])
    assert_same(opt.state_dict()["state"], saved["optimizer"]["state"])


def test_state_a_fresh_optimizer_lacks_is_created_where_torch_places_it(plain_ckpt):
    """New optimizer state is allocated once, where torch's load would put it (step on the CPU, unless fused)."""
    path, saved = plain_ckpt
    for fused in (False, True):
        model = TinyNet(6)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        dr.resume(path, model=model, optimizer=opt)
        assert_same(opt.state_dict()["state"], saved["optimizer"]["state"])
        assert all(s["step"].device.type == "cpu" and s["step"].dtype == torch.float32 for s in opt.state.values())
        train_steps(model, opt, BATCHES[3:4])  # the restored state trains (fused checks its devices)
