"""resume's per-part options: allow_missing, optimizer_hparams, key_prefix, ema, part_keys; how much was applied;
the warnings that say what a resume did not do; argparse.Namespace in a file."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel

import dist_resume as dr
from dist_resume._checkpoint.options import OptimizerHparams
from dist_resume._format.archive import read_archive
from dist_resume._layout.layout import Key, split_checkpoint
from tests.models import TinyNet, assert_same, make_batches, snapshot, train_steps, wrap

BATCHES = make_batches(4)


def _trained(seed=0, lr=1e-3, steps=2, scheduler=False):
    model = TinyNet(seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    train_steps(model, opt, BATCHES[:steps], scheduler=sched)
    return model, opt, sched


def _fresh(seed=5, lr=1e-3, scheduler=False):
    model = TinyNet(seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    return model, opt, sched


def _plain_file(tmp_path, model, opt, name="plain.pt", **more):
    """A foreign ``{"model", "optimizer"}`` file, as most training scripts write it."""
    path = tmp_path / name
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **more}, path)
    return path


# ---------------------------------------------------------------- ResumeOptions itself


def test_resume_options_is_one_frozen_keyword_only_value_validated_when_built():
    opts = dr.ResumeOptions(allow_missing=["scheduler", "ema"], optimizer_hparams="current", part_keys={"model": "net"})
    assert opts.allow_missing == frozenset({"scheduler", "ema"})  # normalised once
    assert opts.optimizer_hparams is OptimizerHparams.CURRENT and opts.part_keys == {"model": "net"}
    assert dr.ResumeOptions(allow_missing="all").allow_missing == frozenset(
        {"optimizer", "scheduler", "scaler", "sampler", "ema"}
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.strict = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        dr.ResumeOptions(False)  # type: ignore[misc]  # keyword-only
    assert not hasattr(opts, "__dict__")  # slotted
    cases: list[tuple[dict[str, Any], str]] = [
        ({"strict": "no"}, "strict must be True or False"),
        ({"rng": 1}, "rng must be True or False"),
        ({"key_prefix": "model"}, "key_prefix must be a dot-separated key prefix ending in '.'"),
        ({"part_keys": {"modle": "net"}}, "part_keys names unknown part"),
        ({"map_location": "cpu", "broadcast_from_rank0": True}, "nothing to map"),
    ]
    for bad, match in cases:
        with pytest.raises(dr.errors.UsageError, match=match):
            dr.ResumeOptions(**bad)
    with pytest.raises(dr.errors.UsageError, match="unknown parts"):
        dataclasses.replace(opts, allow_missing="schedular")  # a changed copy is validated too


# ---------------------------------------------------------------- allow_missing


def test_allow_missing_skips_an_absent_scheduler_and_keeps_the_model_strict(tmp_path):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, sched2 = _fresh(scheduler=True)
    before_sched = sched2.state_dict()
    res = dr.resume(
        path, model=model2, optimizer=opt2, scheduler=sched2, options=dr.ResumeOptions(allow_missing=("scheduler",))
    )
    assert res.restored == ("model", "optimizer") and res.skipped == ("scheduler", "rng")  # a plain file: no RNG
    assert sched2.state_dict() == before_sched
    assert_same(snapshot(model2)["model"], snapshot(model)["model"])
    # the model keys stay strict: a model with one more layer still refuses, and nothing changes
    bigger = nn.Sequential()
    bigger.add_module("net", TinyNet(7))
    before = snapshot(bigger)["model"]
    with pytest.raises(dr.errors.KeyMismatchError):
        dr.resume(path, model=bigger, options=dr.ResumeOptions(allow_missing="all"))
    assert_same(snapshot(bigger)["model"], before)


def test_a_missing_part_not_allowed_raises_naming_allow_missing_and_changes_nothing(tmp_path):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, sched2 = _fresh(scheduler=True)
    before = snapshot(model2, opt2, sched2)
    with pytest.raises(dr.errors.StateMismatchError, match=r"allow_missing=\('scheduler',\)"):
        dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2)
    assert_same(snapshot(model2, opt2, sched2), before)


@pytest.mark.parametrize("names", [("scheduler", "sheduler"), ("model",), [1]])
def test_allow_missing_with_an_unknown_name_lists_the_valid_ones(tmp_path, names):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)
    with pytest.raises(dr.errors.UsageError) as info:
        dr.resume(path, model=TinyNet(1), options=dr.ResumeOptions(allow_missing=names))
    assert isinstance(info.value, ValueError)
    for valid in ("'optimizer'", "'scheduler'", "'scaler'", "'sampler'", "'ema'", "'all'"):
        assert valid in str(info.value)
    assert "'rng'" not in str(info.value)  # absent RNG state needs no permission


def test_allow_missing_rng_is_refused_because_absent_rng_state_is_skipped_anyway():
    with pytest.raises(dr.errors.UsageError, match="allow_missing names 'rng', which needs no permission") as info:
        dr.ResumeOptions(allow_missing=("scheduler", "rng"))
    assert "rng=False" in info.value.hint


def test_allow_missing_all_and_a_single_name(tmp_path):
    model, _, _ = _trained()
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)
    model2, opt2, sched2 = _fresh(scheduler=True)
    scaler = torch.amp.GradScaler("cpu")
    sampler = dr.ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    ema = AveragedModel(TinyNet(3))
    res = dr.resume(
        path,
        model=model2,
        optimizer=opt2,
        scheduler=sched2,
        scaler=scaler,
        dataloader=sampler,
        ema=ema,
        options=dr.ResumeOptions(rng=True, allow_missing="all"),
    )
    assert res.restored == ("model",)
    assert res.skipped == ("optimizer", "scheduler", "scaler", "sampler", "ema", "rng")
    res = dr.resume(path, model=TinyNet(1), optimizer=_fresh()[1], options=dr.ResumeOptions(allow_missing="optimizer"))
    assert res.skipped == ("optimizer", "rng")


def test_strict_false_still_accepts_missing_parts_but_says_allow_missing_is_precise(tmp_path, caplog):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, sched2 = _fresh(scheduler=True)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        res = dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2, options=dr.ResumeOptions(strict=False))
    assert res.skipped == ("scheduler", "rng")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("strict=False skipped the scheduler" in m and "allow_missing=('scheduler',)" in m for m in warned)


# ---------------------------------------------------------------- optimizer_hparams


def test_optimizer_hparams_checkpoint_takes_the_files_values_and_logs_each_difference(tmp_path, caplog):
    model, opt, _ = _trained(lr=1.25e-4)
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, _ = _fresh(lr=5e-2)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        dr.resume(path, model=model2, optimizer=opt2)
    assert opt2.param_groups[0]["lr"] == 1.25e-4
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("group 0 lr: checkpoint 0.000125, this optimizer 0.05" in m for m in info), info


@pytest.mark.parametrize("value", ["current", OptimizerHparams.CURRENT])
def test_optimizer_hparams_current_keeps_the_live_groups_and_restores_the_state(tmp_path, caplog, value):
    model, opt, _ = _trained(lr=1.25e-4)
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, _ = _fresh(lr=5e-2)
    opt2.param_groups[0]["weight_decay"] = 0.5
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        res = dr.resume(path, model=model2, optimizer=opt2, options=dr.ResumeOptions(optimizer_hparams=value))
    assert opt2.param_groups[0]["lr"] == 5e-2 and opt2.param_groups[0]["weight_decay"] == 0.5
    saved, now = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert_same(now, saved)
    assert res.applied["optimizer"] == (len(list(model.parameters())),) * 2
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("keeping this optimizer's: group 0 weight_decay: checkpoint 0.01, this optimizer 0.5" in m for m in info)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def test_optimizer_hparams_current_with_a_restored_scheduler_warns_that_it_will_set_lr(tmp_path, caplog):
    model, opt, sched = _trained(lr=1e-3, scheduler=True)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=2)
    model2, opt2, sched2 = _fresh(lr=5e-2, scheduler=True)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dr.resume(
            path, model=model2, optimizer=opt2, scheduler=sched2, options=dr.ResumeOptions(optimizer_hparams="current")
        )
    assert opt2.param_groups[0]["lr"] == 5e-2 and opt2.param_groups[0]["initial_lr"] == 5e-2
    assert any("recomputes lr at its next step() from its own saved state" in r.getMessage() for r in caplog.records)


def test_optimizer_hparams_current_with_the_same_lr_and_a_scheduler_does_not_warn(tmp_path, caplog):
    model, opt, sched = _trained(lr=1e-3, scheduler=True)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=2)
    model2, opt2, sched2 = _fresh(lr=1e-3, scheduler=True)
    opt2.param_groups[0]["lr"] = opt.param_groups[0]["lr"]  # the same lr as the file's, wherever the schedule is
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dr.resume(
            path, model=model2, optimizer=opt2, scheduler=sched2, options=dr.ResumeOptions(optimizer_hparams="current")
        )
    assert not [r for r in caplog.records if "recomputes lr" in r.getMessage()]


def test_a_differing_lr_with_a_restored_scheduler_says_the_scheduler_sets_it(tmp_path, caplog):
    model, opt, sched = _trained(lr=1e-3, scheduler=True)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=2)
    model2, opt2, sched2 = _fresh(lr=5e-2, scheduler=True)
    with caplog.at_level(logging.DEBUG, logger="dist_resume"):
        dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2)
    lines = [r for r in caplog.records if "group 0 lr:" in r.getMessage()]
    assert lines and all("an LR scheduler sets it; the scheduler is restored too" in r.getMessage() for r in lines)
    assert {r.levelno for r in lines} == {logging.DEBUG}  # the default, an ordinary resume: no news


def test_rng_on_a_file_without_rng_state_leaves_the_streams_and_says_so_once(tmp_path, caplog):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)  # save_checkpoint always stores RNG state; a plain file has none
    fresh = _fresh()[0]  # seeds torch's RNG: take the streams after it
    before = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        result = dr.resume(path, model=fresh)  # rng=True is the default, on resume as on save
    assert result.restored == ("model",) and result.skipped == ("rng",)
    assert torch.equal(torch.get_rng_state(), before)
    said = [r for r in caplog.records if "holds no RNG state" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert "the RNG streams are left as they are" in said[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        result = dr.resume(path, model=fresh, options=dr.ResumeOptions(rng=False))
    assert result.skipped == () and not [r for r in caplog.records if "RNG" in r.getMessage()]
    # strict or not, an absent RNG part never raises
    assert dr.resume(path, model=fresh, options=dr.ResumeOptions(strict=True)).skipped == ("rng",)


def test_optimizer_hparams_unknown_value_is_a_usage_error(tmp_path):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt)
    model2, opt2, _ = _fresh()
    before = snapshot(model2, opt2)
    with pytest.raises(dr.errors.UsageError, match="'checkpoint', 'current'"):
        dr.resume(path, model=model2, optimizer=opt2, options=dr.ResumeOptions(optimizer_hparams="live"))
    assert_same(snapshot(model2, opt2), before)


# ---------------------------------------------------------------- sampler warning, step


def test_sampler_state_without_a_sampler_warns_that_the_epoch_restarts(tmp_path, caplog):
    model, opt, _ = _trained()
    sampler = dr.ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
    it = iter(sampler)
    next(it)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, dataloader=sampler, step=2)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        res = dr.resume(path, model=TinyNet(1), optimizer=_fresh()[1])
    assert res.step == 2  # optimizer steps completed: the loop continues at res.step
    assert any("the epoch restarts from its first batch" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- never a silent half-restore


def test_strict_false_where_nothing_fits_raises_and_changes_nothing(tmp_path):
    path = tmp_path / "other.pt"
    torch.save({"model": nn.Linear(5, 5).state_dict()}, path)
    model = TinyNet(1)
    before = snapshot(model)
    with pytest.raises(dr.errors.KeyMismatchError, match="nothing in the checkpoint fits TinyNet") as info:
        dr.resume(path, model=model, options=dr.ResumeOptions(strict=False))
    assert set(info.value.unexpected) == {"weight", "bias"}
    assert set(info.value.missing) == set(model.state_dict())
    assert_same(snapshot(model), before)


def test_applied_counts_what_each_part_restored(tmp_path):
    model, opt, _ = _trained()
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=2)
    n_keys, n_params = len(model.state_dict()), len(list(model.parameters()))
    res = dr.resume(path, model=TinyNet(1), optimizer=_fresh()[1])
    assert res.applied == {"model": (n_keys, n_keys), "optimizer": (n_params, n_params)}
    # a model with one more layer, strict=False: the keys that fit are loaded, the others counted
    bigger = TinyNet(1)
    bigger.extra = nn.Linear(2, 2)
    res = dr.resume(path, model=bigger, options=dr.ResumeOptions(strict=False))
    assert res.applied == {"model": (n_keys, n_keys + 2)} and res.restored == ("model", "rng")
    assert sorted(res.missing_keys) == ["extra.bias", "extra.weight"]


def test_an_optimizer_saved_before_its_first_step_counts_as_restored(tmp_path):
    model = TinyNet(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=0)
    opt2 = torch.optim.SGD(TinyNet(1).parameters(), lr=0.1)
    res = dr.resume(path, model=TinyNet(1), optimizer=opt2)
    assert res.restored == ("model", "optimizer", "rng") and res.applied["optimizer"][0] == 0
    assert opt2.param_groups[0]["lr"] == 0.3


# ---------------------------------------------------------------- key_prefix


class _LitModule(nn.Module):
    """The attribute layout of a LightningModule holding ``self.model`` (and a loss with a buffer)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.model = TinyNet(seed)


def _lightning_file(tmp_path, with_names=False):
    lit = _LitModule(0)
    params = lit.named_parameters() if with_names else lit.parameters()
    opt = torch.optim.AdamW(params, lr=1e-3)
    train_steps(lit.model, opt, BATCHES[:2])
    path = tmp_path / "epoch=0-step=2.ckpt"
    torch.save(
        {
            "epoch": 0,
            "global_step": 2,
            "pytorch-lightning_version": "2.6.0",
            "state_dict": lit.state_dict(),
            "loops": {},
            "callbacks": {},
            "optimizer_states": [opt.state_dict()],
            "lr_schedulers": [],
            "hparams_name": "kwargs",
            "hyper_parameters": {"lr": 1e-3},
        },
        path,
    )
    return path, lit, opt


@pytest.mark.parametrize("with_names", [False, True])
def test_key_prefix_loads_the_sub_tree_into_the_inner_module(tmp_path, with_names):
    path, lit, opt = _lightning_file(tmp_path, with_names)
    inner = TinyNet(3)
    opt2 = torch.optim.AdamW(inner.named_parameters(), lr=1e-3)
    res = dr.resume(path, model=inner, optimizer=opt2, options=dr.ResumeOptions(key_prefix="model."))
    assert res.step == 2 and res.restored == ("model", "optimizer")
    assert res.unexpected_keys == [] and res.missing_keys == []
    assert_same(snapshot(inner)["model"], snapshot(lit.model)["model"])
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])


def test_a_key_prefix_that_matches_nothing_names_the_prefixes_present(tmp_path):
    path, _, _ = _lightning_file(tmp_path)
    inner = TinyNet(3)
    before = snapshot(inner)
    with pytest.raises(dr.errors.KeyMismatchError, match=r"key_prefix='net\.'.*'model\.'"):
        dr.resume(path, model=inner, options=dr.ResumeOptions(key_prefix="net."))
    with pytest.raises(dr.errors.UsageError):
        dr.resume(path, model=inner, options=dr.ResumeOptions(key_prefix="model"))
    assert_same(snapshot(inner), before)


@pytest.mark.parametrize("strict", [True, False])
def test_a_model_under_a_prefix_gets_the_exact_key_prefix_hint(tmp_path, strict):
    path, _, _ = _lightning_file(tmp_path)
    inner = TinyNet(3)
    before = snapshot(inner)
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.resume(path, model=inner, options=dr.ResumeOptions(strict=strict))
    assert "pass key_prefix='model.'" in str(info.value)
    assert "strict=False" not in str(info.value)  # the advice that loaded 0 of 9 weights
    assert_same(snapshot(inner), before)


def test_no_key_prefix_hint_when_removing_the_prefix_would_not_fit(tmp_path):
    path = tmp_path / "c.pt"
    torch.save({"state_dict": {f"model.{k}": v for k, v in nn.Linear(4, 3).state_dict().items()}}, path)
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.resume(path, model=TinyNet(3))
    assert "key_prefix='" not in str(info.value) and "strict=False would load nothing" in str(info.value)


# ---------------------------------------------------------------- EMA


def _ema_run(inner_wrapper="plain"):
    model = TinyNet(0)
    ema = AveragedModel(wrap(TinyNet(0), inner_wrapper))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for batch in BATCHES[:3]:
        train_steps(model, opt, [batch])
        ema.update_parameters(model)
    return model, opt, ema


def _ema_weights(ema):
    sd = ema.state_dict()
    inner = {k.split("module.")[-1]: v for k, v in sd.items() if k != "n_averaged"}
    return {**inner, "n_averaged": sd["n_averaged"]}


@pytest.mark.parametrize(("saved_from", "restored_into"), [("plain", "dp"), ("dp", "plain"), ("dp", "dp_dp")])
def test_ema_round_trip_across_key_prefixes(tmp_path, saved_from, restored_into):
    model, opt, ema = _ema_run(saved_from)
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, ema=ema, step=3)
    stored = torch.load(path, weights_only=True)[Key.EMA]
    assert set(stored) == set(TinyNet(0).state_dict()) | {"n_averaged"}  # canonical keys
    ema2 = AveragedModel(wrap(TinyNet(4), restored_into))
    res = dr.resume(path, model=TinyNet(4), optimizer=torch.optim.AdamW(TinyNet(4).parameters()), ema=ema2)
    assert res.restored == ("model", "ema", "optimizer", "rng")
    assert int(ema2.n_averaged) == 3
    assert_same(_ema_weights(ema2), _ema_weights(ema))
    assert res.applied["ema"] == (len(ema2.state_dict()), len(ema2.state_dict()))


def test_ema_into_a_plain_module_and_through_the_manager(tmp_path):
    model, opt, ema = _ema_run()
    manager = dr.CheckpointManager(tmp_path / "run", keep_last=2)
    manager.save(3, model=model, optimizer=opt, ema=ema)
    plain = TinyNet(9)
    res = dr.resume(tmp_path / "run", model=TinyNet(9), ema=plain)
    assert "ema" in res.restored
    assert_same(plain.state_dict(), ema.module.state_dict())


def test_ema_missing_or_not_fitting_changes_nothing(tmp_path):
    model, opt, _ = _trained()
    path = tmp_path / "c.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=2)
    model2, opt2, _ = _fresh()
    ema2 = AveragedModel(TinyNet(2))
    before = snapshot(model2, opt2)
    with pytest.raises(dr.errors.StateMismatchError, match=r"no ema state.*allow_missing=\('ema',\)"):
        dr.resume(path, model=model2, optimizer=opt2, ema=ema2)
    assert_same(snapshot(model2, opt2), before)
    assert dr.resume(
        path, model=model2, optimizer=opt2, ema=ema2, options=dr.ResumeOptions(allow_missing=("ema",))
    ).skipped == ("ema",)
    # an EMA of another shape: refused before the model or optimizer changed
    _, _, ema = _ema_run()
    dr.save_checkpoint(path, model=model, optimizer=opt, ema=ema, step=2)
    model3, opt3, _ = _fresh()
    before = snapshot(model3, opt3)
    with pytest.raises(dr.errors.KeyMismatchError, match="EMA state"):
        dr.resume(path, model=model3, optimizer=opt3, ema=AveragedModel(TinyNet(2, width=5)))
    assert_same(snapshot(model3, opt3), before)


# ---------------------------------------------------------------- argparse.Namespace, part_keys


def test_args_namespace_loads_by_default_and_comes_back_in_extra(tmp_path):
    model, opt, _ = _trained()
    path = _plain_file(tmp_path, model, opt, args=argparse.Namespace(lr=0.1, epochs=90), epoch=3)
    res = dr.resume(path, model=TinyNet(1), optimizer=_fresh()[1])
    assert res.extra["args"] == argparse.Namespace(lr=0.1, epochs=90) and res.epoch == 3
    assert read_archive(path).obj["args"].epochs == 90  # the CLI's reader too


@pytest.mark.skipif(
    "part_keys" not in inspect.signature(split_checkpoint).parameters, reason="layout detection not merged yet"
)
def test_part_keys_name_the_model_entry(tmp_path):
    model, _, _ = _trained()
    path = tmp_path / "snapshot.pt"
    torch.save({"MODEL_STATE": model.state_dict(), "BEST": model.state_dict(), "EPOCHS_RUN": 4}, path)
    model2 = TinyNet(1)
    dr.resume(path, model=model2, options=dr.ResumeOptions(part_keys={"model": "MODEL_STATE"}))
    assert_same(snapshot(model2)["model"], snapshot(model)["model"])


@pytest.mark.parametrize(
    ("call", "said"),
    [
        (lambda p, m, d: dr.resume(p, model=m, strict=False), "options=dist_resume.ResumeOptions(strict=False)"),  # type: ignore[call-arg]
        (lambda p, m, d: dr.resume(p, model=m, allow_missing=("scheduler",)), "ResumeOptions(allow_missing=("),  # type: ignore[call-arg]
        (lambda p, m, d: dr.resume(p, model=m, rng=True), "options=dist_resume.ResumeOptions(rng=True)"),  # type: ignore[call-arg]
        (lambda p, m, d: dr.resume(p, model=m, sampler=None), "sampler= became dataloader="),  # type: ignore[call-arg]
        (lambda p, m, d: dr.CheckpointManager(d, model=m).resume(strict=False), "ResumeOptions(strict=False)"),  # type: ignore[call-arg]
        (lambda p, m, d: dr.CheckpointManager(d, model=m).resume(broadcast_from_rank0=True), "ResumeOptions("),  # type: ignore[call-arg]
        (lambda p, m, d: dr.CheckpointManager(d, model=m).save(1, rng=True), "always saves every rank's RNG"),  # type: ignore[call-arg]
        (lambda p, m, d: dr.save_checkpoint(p, model=m, sampler=None), "sampler= became dataloader="),  # type: ignore[call-arg]
        (lambda p, m, d: dr.save_checkpoint_async(p, model=m, after_write=print), "no longer takes after_write="),  # type: ignore[call-arg]
    ],
    ids=["strict", "allow_missing", "rng", "sampler", "mgr-strict", "mgr-broadcast", "mgr-save-rng", "save", "async"],
)
def test_a_keyword_0_3_moved_is_an_error_naming_its_new_spelling(tmp_path: Any, call: Any, said: str) -> None:
    model = torch.nn.Linear(2, 2)
    path = dr.save_checkpoint(tmp_path / "c.pt", model=model)
    with pytest.raises(dr.errors.UsageError) as info:
        call(path, model, tmp_path / "run")
    assert said in str(info.value) and "Migrating from 0.2' in CHANGELOG.md" in str(info.value), str(info.value)
