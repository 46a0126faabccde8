"""plan_restore validates everything and changes nothing; RestorePlan.apply changes the live objects."""

from __future__ import annotations

import random

import pytest
import torch

import dist_resume as dr
from dist_resume._checkpoint.objects import LiveObjects
from dist_resume._checkpoint.plan.restore_plan import plan_restore
from dist_resume._core.tree import iter_tensors, map_tensors
from dist_resume._layout.layout import Key, split_checkpoint
from dist_resume._source.open import load_checkpoint
from tests.models import TinyNet, assert_same, make_batches, snapshot, train_steps

BATCHES = make_batches(5)


def _objects(seed):
    """Model, optimizer, scheduler, GradScaler and sampler that have trained a little on their own."""
    model = TinyNet(seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    sampler = dr.ResumableDistributedSampler(list(range(10)), num_replicas=1, rank=0, seed=4)
    return model, opt, sched, scaler, sampler


def _checkpoint(tmp_path):
    model, opt, sched, scaler, sampler = _objects(seed=0)
    train_steps(model, opt, BATCHES[:3], scheduler=sched, scaler=scaler)
    it = iter(sampler)
    next(it), next(it)
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, scaler=scaler, dataloader=sampler, step=3)
    return path


def _live(seed=6):
    objs = _objects(seed)
    train_steps(objs[0], objs[1], BATCHES[3:5], scheduler=objs[2], scaler=objs[3])
    return objs


def _frozen(model, opt, sched, scaler, sampler):
    return {
        **snapshot(model, opt, sched, scaler),
        "sampler": sampler.state_dict(),
        "rng": (torch.get_rng_state(), random.getstate()),
    }


def _plan(parts, model, optimizer=None, scheduler=None, scaler=None, sampler=None, **options):
    return plan_restore(parts, LiveObjects(model, optimizer, scheduler, scaler, sampler), dr.ResumeOptions(**options))


def _parts(path, **edits):
    obj = load_checkpoint(path, mmap=False)
    for key, value in edits.items():
        obj[key] = value
    return split_checkpoint(obj, "test checkpoint")


def test_the_plan_changes_nothing_until_apply(tmp_path):
    path = _checkpoint(tmp_path)
    model, opt, sched, scaler, sampler = objs = _live()
    frozen = _frozen(*objs)
    plan = _plan(_parts(path), model, opt, sched, scaler, sampler, rng=True)
    assert_same(_frozen(*objs), frozen)
    assert plan.restore == ("model", "scaler", "optimizer", "scheduler", "sampler", "rng")
    assert plan.skipped == () and plan.missing_keys == () and plan.unexpected_keys == ()
    assert plan.apply() == plan.restore
    saved = torch.load(path, weights_only=True)
    assert_same({k: v.detach() for k, v in model.state_dict().items()}, saved[Key.MODEL])
    assert_same(opt.state_dict()["state"], saved[Key.OPTIMIZER]["state"])
    assert sched.state_dict() == saved[Key.SCHEDULER] and scaler.state_dict() == saved[Key.SCALER]
    assert sampler.state_dict()["consumed"] == 2
    assert torch.equal(torch.get_rng_state(), saved[Key.RNG][0]["torch"])


def _bad_rng():
    return [{"seed": 1}]  # no 'python'/'torch' streams for rank 0


@pytest.mark.parametrize(
    ("edits", "error", "words"),
    [
        ({Key.MODEL: {}}, dr.errors.KeyMismatchError, "missing from checkpoint"),
        ({Key.SCHEDULER: {"not": "a StepLR"}}, dr.errors.StateMismatchError, "StepLR"),
        ({Key.SCALER: {}}, dr.errors.StateMismatchError, "disabled scaler"),
        ({Key.SAMPLER: {"epoch": 0, "consumed": 99, "num_samples": 10}}, dr.errors.StateMismatchError, "exceeds"),
        ({Key.RNG: "junk"}, dr.errors.StateMismatchError, "not a list of per-rank states"),
        ({Key.RNG: _bad_rng()}, dr.errors.StateMismatchError, "RNG state of rank 0 lacks"),
    ],
    ids=["model", "scheduler", "scaler", "sampler", "rng_entry", "rng_rank"],
)
def test_a_failed_validation_raises_before_any_change(tmp_path, edits, error, words):
    path = _checkpoint(tmp_path)
    model, opt, sched, scaler, sampler = objs = _live()
    frozen = _frozen(*objs)
    with pytest.raises(error, match=words):
        _plan(_parts(path, **edits), model, opt, sched, scaler, sampler, rng=True)
    assert_same(_frozen(*objs), frozen)


def test_resume_validates_the_rng_entry_before_changing_anything(tmp_path):
    """The RNG entry used to be checked after model and optimizer had been restored."""
    path = _checkpoint(tmp_path)
    obj = torch.load(path, weights_only=True)
    obj[Key.RNG] = _bad_rng()
    torch.save(obj, path)
    model, opt, sched, scaler, sampler = objs = _live()
    frozen = _frozen(*objs)
    with pytest.raises(dr.errors.StateMismatchError, match="RNG state of rank 0"):
        dr.resume(
            path,
            model=model,
            optimizer=opt,
            scheduler=sched,
            scaler=scaler,
            dataloader=sampler,
            options=dr.ResumeOptions(rng=True),
        )
    assert_same(_frozen(*objs), frozen)


def test_strict_false_plans_what_the_file_has_and_apply_returns_it(tmp_path):
    path = _checkpoint(tmp_path)
    model, opt, sched, scaler, sampler = _live()
    parts = _parts(path, **{Key.SCHEDULER: None, Key.SAMPLER: None, Key.RNG: None})
    with pytest.raises(dr.errors.StateMismatchError, match="has no scheduler state"):
        _plan(parts, model, opt, sched, scaler, sampler)
    frozen_sched = sched.state_dict()
    plan = _plan(parts, model, opt, sched, scaler, sampler, rng=True, strict=False)
    assert plan.restore == ("model", "scaler", "optimizer")
    assert plan.skipped == ("scheduler", "sampler", "rng")
    assert plan.apply() == ("model", "scaler", "optimizer")
    assert sched.state_dict() == frozen_sched


def test_a_plan_built_on_stand_ins_receives_its_data_at_the_commit_straight_into_the_live_tensors(tmp_path):
    """Broadcast loading: validate on meta tensors, rebind what the steps need, write the rest at the commit."""
    path = _checkpoint(tmp_path)
    real = load_checkpoint(path, mmap=False)
    stand_ins = map_tensors(real, lambda t: torch.empty_like(t, device="meta"))
    model, opt, sched, scaler, sampler = _live()
    params = {k: (v, v.data_ptr()) for k, v in model.state_dict(keep_vars=True).items()}
    plan = _plan(split_checkpoint(stand_ins, "stand-ins"), model, opt, sched, scaler, rng=False)
    late = {id(t) for t in plan.late_tensors()}
    stand_in_model = stand_ins[Key.MODEL]
    assert {id(stand_in_model[k]) for k in params} <= late  # every model entry is written at the commit
    stand_in_state = [v for st in stand_ins[Key.OPTIMIZER]["state"].values() for v in st.values()]
    assert {id(v) for v in stand_in_state} <= late  # and every optimizer state tensor
    real_of = {id(old): new for old, new in zip(iter_tensors(stand_ins), iter_tensors(real), strict=True)}
    plan = plan.rebind({k: v for k, v in real_of.items() if k not in late})  # what the steps need, first
    written: list[int] = []

    def transfer(pairs):
        for saved, dst in pairs:
            assert saved.device.type == "meta"  # the data of late tensors was never anywhere but in the stand-in
            dst.copy_(real_of[id(saved)])
            written.append(id(saved))

    assert plan.apply(transfer=transfer) == ("model", "scaler", "optimizer", "scheduler")
    assert set(written) == late
    after = model.state_dict(keep_vars=True)
    assert all(after[k] is t and t.data_ptr() == p for k, (t, p) in params.items())
    assert_same({k: v.detach() for k, v in after.items()}, real[Key.MODEL])
    assert_same(opt.state_dict()["state"], real[Key.OPTIMIZER]["state"])
    assert sched.state_dict() == real[Key.SCHEDULER]
