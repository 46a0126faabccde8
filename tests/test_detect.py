"""Recognising a checkpoint's parts by what they hold: the files real training scripts write."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._core.tree import map_tensors
from dist_resume._layout.layout import Layout, split_checkpoint
from dist_resume._state.prefix import add_prefix
from tests.models import TinyNet


def _trained() -> tuple[TinyNet, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = TinyNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


@pytest.fixture
def trained():
    return _trained()


def test_torchrun_tutorial_snapshot(trained):
    """PyTorch's DDP tutorial (multigpu_torchrun.py) saves {"MODEL_STATE": model.module.state_dict(), "EPOCHS_RUN": epoch}."""
    model, _, _ = trained
    ddp_like = nn.DataParallel(model)  # same `module.` wrapper as DDP, no process group needed
    snapshot = {"MODEL_STATE": ddp_like.module.state_dict(), "EPOCHS_RUN": 3}
    parts = split_checkpoint(snapshot)
    assert parts.layout is Layout.DETECTED and parts.layout.value == "detected"
    assert parts.model is snapshot["MODEL_STATE"] and parts.epoch == 3 and parts.step is None
    assert parts.keys == {"model": "MODEL_STATE", "epoch": "EPOCHS_RUN"}
    assert parts.describe_keys() == "model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'"
    assert parts.optimizer is None and parts.extra == {"EPOCHS_RUN": 3}


def test_mingpt_ddp_snapshot(trained):
    """pytorch/examples minGPT-ddp saves model_state, optimizer_state and finished_epoch."""
    model, opt, _ = trained
    obj = {"model_state": model.state_dict(), "optimizer_state": opt.state_dict(), "finished_epoch": 7}
    parts = split_checkpoint(obj)
    assert parts.model is obj["model_state"] and parts.optimizer is obj["optimizer_state"]
    assert parts.epoch == 7
    assert parts.keys == {"model": "model_state", "optimizer": "optimizer_state", "epoch": "finished_epoch"}


def test_free_naming_with_ddp_prefixed_model(trained):
    model, opt, sched = trained
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0)
    obj = {
        "net": add_prefix(model.state_dict()),
        "opt": opt.state_dict(),
        "sched": sched.state_dict(),
        "amp": scaler.state_dict(),
        "it": 500,
        "best": 0.5,
    }
    parts = split_checkpoint(obj)
    assert parts.layout is Layout.DETECTED
    assert parts.model is obj["net"] and parts.optimizer is obj["opt"]
    assert parts.scheduler is obj["sched"] and parts.scaler is obj["amp"]
    assert parts.keys == {"model": "net", "optimizer": "opt", "scheduler": "sched", "scaler": "amp", "step": "it"}
    assert parts.step == 500  # `it`, the shortest step name scripts use (lowest priority)
    assert parts.extra == {"it": 500, "best": 0.5}  # numbers are read, not restored: they stay in extra


@pytest.mark.parametrize(
    "name, part",
    [("EPOCH", "epoch"), ("Current_Epoch", "epoch"), ("ITER", "step"), ("num_steps", "step"), ("It", "step")],
)
def test_counter_names_in_any_case(trained, name, part):
    parts = split_checkpoint({"weights": trained[0].state_dict(), name: 11})
    assert getattr(parts, part) == 11 and parts.keys[part] == name


def test_nested_one_level(trained):
    model, opt, sched = trained
    obj = {"state": {"network": model.state_dict(), "optim": opt.state_dict(), "global_step": 9}, "cfg": {"lr": 1}}
    parts = split_checkpoint(obj)
    assert parts.layout is Layout.DETECTED
    assert parts.model is obj["state"]["network"] and parts.optimizer is obj["state"]["optim"]
    assert parts.step == 9
    assert parts.keys == {"model": "state.network", "optimizer": "state.optim", "step": "state.global_step"}
    assert parts.extra == {"state": {"global_step": 9}, "cfg": {"lr": 1}}


def test_two_models_are_ambiguous():
    obj = {"generator": TinyNet().state_dict(), "discriminator": nn.Linear(3, 1).state_dict(), "step": 3}
    with pytest.raises(dr.errors.NotACheckpointError) as info:
        split_checkpoint(obj, "checkpoint 'gan.pt'")
    msg = str(info.value)
    assert "'generator'" in msg and "'discriminator'" in msg and "checkpoint 'gan.pt'" in msg
    assert "part_keys={'model': 'generator'}" in msg


def test_model_keys_pick_the_entry_that_fits():
    disc = nn.Linear(3, 1)
    obj = {"generator": TinyNet().state_dict(), "discriminator": add_prefix(disc.state_dict())}
    parts = split_checkpoint(obj, model_keys=TinyNet().state_dict().keys())
    assert parts.model is obj["generator"] and parts.keys["model"] == "generator"
    ddp_keys = add_prefix(disc.state_dict()).keys()
    assert split_checkpoint(obj, model_keys=[f"_orig_mod.{k}" for k in ddp_keys]).model is obj["discriminator"]
    assert split_checkpoint(obj, model_keys=disc.state_dict().keys()).model is obj["discriminator"]


def test_two_optimizers_are_ambiguous(trained):
    model, opt, _ = trained
    obj = {"model": model.state_dict(), "opt_g": opt.state_dict(), "opt_d": opt.state_dict()}
    with pytest.raises(dr.errors.NotACheckpointError, match=r"could each be the optimizer: 'opt_g', 'opt_d'"):
        split_checkpoint(obj)
    assert split_checkpoint(obj, part_keys={"optimizer": "opt_d"}).optimizer is obj["opt_d"]


def test_part_keys_for_every_part(trained):
    model, opt, sched = trained
    scaler = torch.amp.GradScaler("cpu")
    sd = model.state_dict()
    obj = {
        "a": sd,
        "b": dict(sd),
        "c": opt.state_dict(),
        "d": opt.state_dict(),
        "e": {"s1": sched.state_dict(), "s2": sched.state_dict()},
        "f": [scaler.state_dict()],
        "g": dict(sd),
        "h": 4,
        "i": torch.tensor(120),
    }
    names = {
        "model": "b",
        "optimizer": "d",
        "scheduler": "e.s2",
        "scaler": "f",
        "ema": "g",
        "epoch": "h",
        "step": "i",
    }
    parts = split_checkpoint(obj, part_keys=names)
    assert parts.model is obj["b"] and parts.optimizer is obj["d"] and parts.scheduler is obj["e"]["s2"]
    assert parts.scaler is obj["f"][0] and parts.ema is obj["g"] and (parts.epoch, parts.step) == (4, 120)
    assert parts.keys == names
    assert parts.layout is Layout.DETECTED


def test_part_keys_name_that_does_not_exist(trained):
    obj = {"MODEL_STATE": trained[0].state_dict(), "EPOCHS_RUN": 1, "state": {"opt": {}}}
    with pytest.raises(dr.errors.NotACheckpointError) as info:
        split_checkpoint(obj, "checkpoint 'snap.pt'", part_keys={"model": "model_state"})
    msg = str(info.value)
    assert "'model_state'" in msg and "checkpoint 'snap.pt'" in msg
    assert "'MODEL_STATE', 'EPOCHS_RUN', 'state', 'state.opt'" in msg
    with pytest.raises(dr.errors.NotACheckpointError, match="holds int, not a state dict"):
        split_checkpoint(obj, part_keys={"model": "EPOCHS_RUN"})
    with pytest.raises(dr.errors.NotACheckpointError, match="not a whole number"):
        split_checkpoint(obj, part_keys={"epoch": "state"})


def test_unknown_part_name_is_a_usage_error(trained):
    with pytest.raises(dr.errors.UsageError) as info:
        split_checkpoint({"model": trained[0].state_dict()}, part_keys={"weights": "model"})
    assert "'weights'" in str(info.value) and "'model', 'optimizer'" in info.value.hint
    assert isinstance(info.value, ValueError)


def test_part_keys_on_a_toolkit_file(trained, tmp_path):
    model, opt, _ = trained
    dr.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=5, extra={"alt": model.state_dict()})
    obj = torch.load(tmp_path / "c.pt", weights_only=True)
    parts = split_checkpoint(obj, part_keys={"model": "extra.alt"})
    assert parts.layout is Layout.TOOLKIT and parts.model is obj["extra"]["alt"] and parts.step == 5
    assert parts.keys["model"] == "extra.alt"


def test_lightning_layout(trained):
    """Lightning 2.x .ckpt top-level keys, as its own save code writes them (model keys carry `model.`)."""
    model, opt, sched = trained
    obj: dict[str, Any] = {
        "epoch": 2,
        "global_step": 60,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": add_prefix(model.state_dict(), "model."),
        "loops": {"fit_loop": {"state_dict": {}}},
        "callbacks": {},
        "optimizer_states": [opt.state_dict()],
        "lr_schedulers": [sched.state_dict()],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.01},
    }
    parts = split_checkpoint(obj)
    assert parts.layout is Layout.LIGHTNING and parts.layout.value == "lightning"
    assert parts.model is obj["state_dict"]
    assert parts.optimizer is obj["optimizer_states"][0] and parts.scheduler is obj["lr_schedulers"][0]
    assert (parts.epoch, parts.step) == (2, 60)
    assert parts.keys == {
        "model": "state_dict",
        "optimizer": "optimizer_states",
        "scheduler": "lr_schedulers",
        "epoch": "epoch",
        "step": "global_step",
    }


@pytest.mark.parametrize("ema_key", ["model_ema", "state_dict_ema", "ema", "ema_state_dict"])
def test_ema_entries_are_never_the_model(trained, ema_key):
    model, opt, _ = trained
    averaged = torch.optim.swa_utils.AveragedModel(model)
    obj = {"weights": model.state_dict(), ema_key: averaged.state_dict(), "optimizer": opt.state_dict()}
    parts = split_checkpoint(obj)
    assert parts.model is obj["weights"] and parts.ema is obj[ema_key]
    assert parts.keys == {"ema": ema_key, "model": "weights", "optimizer": "optimizer"}
    assert "n_averaged" in parts.ema and ema_key not in (parts.extra or {})


def test_averaged_model_state_is_ema_by_content(trained):
    """torchvision references: AveragedModel keys are module.* + n_averaged, whatever the entry is called."""
    model, _, _ = trained
    obj = {"net": model.state_dict(), "swa": torch.optim.swa_utils.AveragedModel(model).state_dict()}
    parts = split_checkpoint(obj)
    assert parts.model is obj["net"] and parts.ema is obj["swa"]


def test_rng_and_sampler_state_are_recognised(trained):
    sampler_state = {"epoch": 1, "consumed": 8, "num_samples": 16, "shuffle": True, "seed": 0}
    sampler_state |= {"drop_last": False, "world_size": 2}
    rng = {"python": (3, (1, 2), None), "torch": torch.get_rng_state(), "cuda": None, "numpy": None, "seed": 0}
    obj = {
        "weights": trained[0].state_dict(),
        "loader": sampler_state,
        "rng": rng,
        "torch_rng": {"cpu": torch.get_rng_state()},  # a tensor mapping, but RNG bytes: not a model candidate
    }
    parts = split_checkpoint(obj)
    assert parts.model is obj["weights"] and parts.sampler is sampler_state and parts.rng == [rng]
    assert parts.epoch is None  # the sampler's own epoch is not the checkpoint's
    assert parts.extra == {"torch_rng": obj["torch_rng"]}


def test_without_a_model_the_module_like_or_largest_tensor_mapping_wins(trained):
    obj = {"stats": {"mean": torch.zeros(3), "std": torch.ones(3)}, "net": trained[0].state_dict()}
    assert split_checkpoint(obj).model is obj["net"]
    big = {"table": torch.zeros(100)}
    obj = {"small": {"mean": torch.zeros(3)}, "big": big}
    assert split_checkpoint(obj).model is big
    with pytest.raises(dr.errors.NotACheckpointError, match="could each be the model"):
        split_checkpoint({"x": {"a": torch.zeros(3)}, "y": {"b": torch.zeros(3)}})


def test_conventional_name_wins_over_content(trained):
    model, _, _ = trained
    obj = {"model": model.state_dict(), "teacher": TinyNet(seed=1).state_dict()}
    parts = split_checkpoint(obj)
    assert parts.layout is Layout.MODEL_OPTIMIZER and parts.model is obj["model"]
    fits_teacher = nn.Linear(4, 3).state_dict().keys()  # fits neither fully nor partly: the convention stands
    assert split_checkpoint(obj, model_keys=fits_teacher).model is obj["model"]


def test_same_conventional_name_in_two_containers_is_ambiguous(trained):
    sd = trained[0].state_dict()
    obj = {"student": {"model": sd}, "teacher": {"model": dict(sd)}}
    with pytest.raises(dr.errors.NotACheckpointError, match=re.escape("'student.model', 'teacher.model'")):
        split_checkpoint(obj)
    assert split_checkpoint(obj, part_keys={"model": "teacher.model"}).model is obj["teacher"]["model"]


def test_detection_works_on_meta_tensors(trained):
    """dist-resume inspect reads files without their data: detection must not touch tensor values."""
    model, opt, sched = trained

    def meta(obj):
        return map_tensors(obj, lambda t: torch.empty_like(t, device="meta"))

    obj = meta({"MODEL_STATE": add_prefix(model.state_dict()), "opt": opt.state_dict(), "sched": sched.state_dict()})
    obj["EPOCHS_RUN"] = 5
    obj["rng"] = meta({"cpu": torch.get_rng_state()})
    parts = split_checkpoint(obj, model_keys=model.state_dict().keys())
    assert parts.model is obj["MODEL_STATE"] and parts.optimizer is obj["opt"] and parts.scheduler is obj["sched"]
    assert parts.epoch == 5 and next(iter(parts.model.values())).is_meta


def test_tutorial_snapshot_resumes_into_plain_and_wrapped_models(trained, tmp_path):
    model, _, _ = trained
    path = tmp_path / "snapshot.pt"
    torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 4}, path)
    for target in (TinyNet(seed=3), nn.DataParallel(TinyNet(seed=3))):
        result = dr.resume(path, model=target)
        assert result.layout is Layout.DETECTED and result.epoch == 4 and result.restored == ("model",)
        inner = dr.unwrap_model(target)
        for key, value in model.state_dict().items():
            assert torch.equal(inner.state_dict()[key], value), key


def test_mingpt_snapshot_resumes_model_and_optimizer(trained, tmp_path):
    model, opt, _ = trained
    path = tmp_path / "snapshot.pt"
    torch.save({"model_state": model.state_dict(), "optimizer_state": opt.state_dict(), "finished_epoch": 2}, path)
    fresh = TinyNet(seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    result = dr.resume(path, model=fresh, optimizer=fresh_opt)
    assert result.restored == ("model", "optimizer") and result.epoch == 2
    saved = opt.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], saved)


def test_a_conventional_name_holding_several_parts_is_no_convention(trained):
    model, opt, _ = trained
    obj = {"model": model.state_dict(), "optimizer": {"gen": opt.state_dict(), "disc": opt.state_dict()}}
    with pytest.raises(dr.errors.NotACheckpointError, match=re.escape("'optimizer.gen', 'optimizer.disc'")):
        split_checkpoint(obj)
    parts = split_checkpoint(obj, part_keys={"optimizer": "optimizer.disc"})
    assert parts.optimizer is obj["optimizer"]["disc"] and parts.extra == {
        "optimizer": {"gen": obj["optimizer"]["gen"]}
    }


def test_values_that_are_not_parts_stay_in_extra(trained):
    obj = {"model.pt": trained[0].state_dict(), "ema": 0.999, "scaler": None, "step": "7", "args": {"epochs": 90}}
    parts = split_checkpoint(obj)
    assert parts.model is obj["model.pt"] and parts.keys == {"model": "model.pt"}  # a dotted top-level key
    assert parts.ema is None and parts.scaler is None and parts.step is None and parts.epoch is None
    assert parts.extra == {k: v for k, v in obj.items() if k != "model.pt"}


def test_counters_one_level_down_outside_the_model_dict(trained):
    model, opt, _ = trained
    obj = {"net": model.state_dict(), "opt": opt.state_dict(), "progress": {"epoch": 3, "global_step": 100}}
    parts = split_checkpoint(obj)
    assert (parts.epoch, parts.step) == (3, 100)
    assert parts.keys["epoch"] == "progress.epoch" and parts.keys["step"] == "progress.global_step"


def test_counters_at_the_top_win_over_those_one_level_down(trained):
    obj = {"net": trained[0].state_dict(), "epoch": 2, "progress": {"epoch": 3}}
    assert split_checkpoint(obj).epoch == 2


@pytest.mark.parametrize(
    "obj_counters",
    [{"Epoch": 3, "epoch": 4}, {"a": {"epoch": 3}, "b": {"epoch": 4}}],
    ids=["case", "two-dicts"],
)
def test_counters_of_equal_rank_that_disagree_are_an_error_never_a_guess(trained, obj_counters):
    obj = {"net": trained[0].state_dict(), **obj_counters}
    with pytest.raises(dr.errors.NotACheckpointError, match="could each be the epoch, with different numbers") as err:
        split_checkpoint(obj)
    assert "part_keys={'epoch':" in str(err.value)
    first = next(iter(obj_counters))
    path = first if first == "Epoch" else "a.epoch"
    assert split_checkpoint(obj, part_keys={"epoch": path}).epoch == 3


def test_counters_of_equal_rank_that_agree_are_one_number(trained):
    assert split_checkpoint({"net": trained[0].state_dict(), "Epoch": 3, "epoch": 3}).epoch == 3


def test_part_keys_on_a_state_dict_for_a_counter_says_what_it_holds_briefly(trained):
    obj = {"net": trained[0].state_dict(), "epoch": 1}
    with pytest.raises(
        dr.errors.NotACheckpointError, match=r"holds \w*Dict with \d+ entries, not a whole number"
    ) as err:
        split_checkpoint(obj, part_keys={"epoch": "net"})
    assert "tensor(" not in str(err.value)


def test_load_checkpoint_part_keys_gives_the_parts_view_of_a_torch_file(trained, tmp_path):
    model, opt, _ = trained
    path = tmp_path / "snap.pt"
    torch.save({"W": model.state_dict(), "V": model.state_dict(), "opt": opt.state_dict(), "it": 7}, path)
    view = dr.load_checkpoint(path, part_keys={"model": "W"})
    assert set(view["model"]) == set(model.state_dict()) and view["optimizer"]["param_groups"]
    assert view["step"] == 7 and view["meta"]["layout"] == "detected"
    assert view["meta"]["part_keys"] == {"model": "W", "optimizer": "opt", "step": "it"}
    assert set(view["extra"]) == {"V", "it"}
    assert set(dr.load_checkpoint(path)) == {"W", "V", "opt", "it"}  # without part_keys: the file as it is
    with pytest.raises(dr.errors.NotACheckpointError, match="no such key; its keys are 'W', 'V', 'opt', 'it'"):
        dr.load_checkpoint(path, part_keys={"model": "MODEL"})
    with pytest.raises(dr.errors.NotACheckpointError, match="could each be the model"):
        dr.load_checkpoint(path, part_keys={})  # the view with nothing named: detection alone, which refuses to guess


def test_a_part_two_entries_could_be_is_refused_only_when_it_is_restored(trained, tmp_path):
    # a GAN file: two models, two optimizers; resuming the generator alone must not trip over the optimizers
    model, opt, _ = trained
    path = tmp_path / "gan.pt"
    torch.save(
        {"G": model.state_dict(), "D": model.state_dict(), "opt_G": opt.state_dict(), "opt_D": opt.state_dict()}, path
    )
    fresh = TinyNet(seed=4)
    result = dr.resume(path, model=fresh, options=dr.ResumeOptions(part_keys={"model": "G"}))
    assert result.restored == ("model",) and result.part_keys == {"model": "G"}
    assert set(result.extra) == {"D", "opt_G", "opt_D"}
    with pytest.raises(dr.errors.NotACheckpointError, match="could each be the optimizer: 'opt_G', 'opt_D'"):
        dr.resume(
            path,
            model=fresh,
            optimizer=torch.optim.AdamW(fresh.parameters()),
            options=dr.ResumeOptions(part_keys={"model": "G"}),
        )
    with pytest.raises(dr.errors.NotACheckpointError, match="could each be the optimizer"):
        split_checkpoint(torch.load(path, weights_only=True), part_keys={"model": "G"})  # every part wanted


def test_mingpt_snapshot_resumes_into_a_wrapped_model_and_names_its_keys(trained, tmp_path, caplog):
    model, opt, _ = trained
    path = tmp_path / "snapshot.pt"
    torch.save({"model_state": model.state_dict(), "optimizer_state": opt.state_dict(), "finished_epoch": 2}, path)
    fresh = nn.DataParallel(TinyNet(seed=5))  # keys under module., like DDP
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        result = dr.resume(path, model=fresh, optimizer=fresh_opt)
    assert result.restored == ("model", "optimizer") and result.epoch == 2
    keys = {"model": "model_state", "optimizer": "optimizer_state", "epoch": "finished_epoch"}
    assert result.part_keys == keys
    assert "model <- 'model_state', optimizer <- 'optimizer_state', epoch <- 'finished_epoch'" in caplog.text
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_a_known_layout_with_one_part_under_another_name_logs_every_key(trained, tmp_path, caplog):
    model, opt, _ = trained
    path = tmp_path / "a.pt"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "Epoch": 3}, path)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        fresh = TinyNet(seed=2)
        result = dr.resume(path, model=fresh, optimizer=torch.optim.AdamW(fresh.parameters(), lr=0.01))
    assert result.part_keys == {"model": "model", "optimizer": "opt", "epoch": "Epoch"}
    assert "optimizer <- 'opt', epoch <- 'Epoch'" in caplog.text
