"""resume(): every layout into every model form, bitwise continuation, and all-or-nothing on failure."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from dist_resume._layout.layout import Key
from tests.helpers import save_with_device_tag
from tests.models import (
    TinyNet,
    TwinNet,
    TwinNetReordered,
    assert_same,
    make_batches,
    single_rank_group,
    snapshot,
    train_steps,
    wrap,
)

BATCHES = make_batches(6)


def _setup(seed=0, *, kind="plain", sched="step", scaler_enabled=True, named=True, opt_cls=torch.optim.AdamW):
    """Model (and its unwrapped net), optimizer, scheduler and GradScaler, built in the order torch wants."""
    net = TinyNet(seed)
    model = wrap(net, kind)
    params = model.named_parameters() if named else model.parameters()
    opt = opt_cls(params, lr=1e-2)
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    if sched == "step":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    elif sched == "onecycle":
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=len(BATCHES))
    else:
        scheduler = None
    scaler = torch.amp.GradScaler("cpu", enabled=scaler_enabled, init_scale=2.0**8, growth_interval=2)
    return net, model, opt, scheduler, scaler


def _trained_checkpoint(tmp_path, n=3, **kwargs):
    net, model, opt, sched, scaler = _setup(**kwargs)
    train_steps(net, opt, BATCHES[:n], scheduler=sched, scaler=scaler)
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(
        path, model=model, optimizer=opt, scheduler=sched, scaler=scaler, step=n, epoch=0, extra={"note": "hi"}
    )
    return path, (net, model, opt, sched, scaler)


# ---------------------------------------------------------------- continuation


@pytest.mark.parametrize("sched", ["step", "onecycle"])
@pytest.mark.parametrize("kind", ["plain", "dp"])
def test_training_continues_bitwise_like_an_uninterrupted_run(tmp_path, sched, kind):
    path, (net, _, opt, scheduler, scaler) = _trained_checkpoint(tmp_path, sched=sched)
    expected_tail = train_steps(net, opt, BATCHES[3:], scheduler=scheduler, scaler=scaler)

    net2, model2, opt2, sched2, scaler2 = _setup(seed=7, kind=kind, sched=sched)
    res = dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert res.restored[:4] == ("model", "scaler", "optimizer", "scheduler")
    assert (res.step, res.epoch, res.extra) == (3, 0, {"note": "hi"})
    dr.check_devices(model2, opt2)

    assert train_steps(model2, opt2, BATCHES[3:], scheduler=sched2, scaler=scaler2) == expected_tail
    assert_same(net2.state_dict(), net.state_dict())
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])
    assert_same(sched2.state_dict(), scheduler.state_dict())
    assert scaler2.state_dict() == scaler.state_dict()
    assert scaler2.get_scale() == scaler.get_scale()


def test_restored_state_is_bitwise_equal(tmp_path):
    path, (net, model, opt, sched, scaler) = _trained_checkpoint(tmp_path, sched="onecycle")
    net2, model2, opt2, sched2, scaler2 = _setup(seed=3, sched="onecycle")
    dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert_same(net2.state_dict(), net.state_dict())
    saved, live = opt.state_dict(), opt2.state_dict()
    assert_same(live["state"], saved["state"])
    assert_same(live["param_groups"], saved["param_groups"])  # lr from the scheduler survives
    assert_same(sched2.state_dict(), sched.state_dict())
    assert scaler2.state_dict() == scaler.state_dict()
    assert sched2.get_last_lr() == sched.get_last_lr()


def test_real_ddp_round_trip_single_to_ddp_and_back(tmp_path):
    path, (net, _, opt, sched, scaler) = _trained_checkpoint(tmp_path)
    expected = train_steps(net, opt, BATCHES[3:5], scheduler=sched, scaler=scaler)
    with single_rank_group(tmp_path):
        net2 = TinyNet(seed=5)
        ddp = DDP(net2)
        opt2 = torch.optim.AdamW(ddp.named_parameters(), lr=1e-2)  # names carry "module."
        sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.5)
        scaler2 = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        dr.resume(path, model=ddp, optimizer=opt2, scheduler=sched2, scaler=scaler2)
        assert opt2.param_groups[0]["param_names"][0] == "module.fc.weight"  # its own names kept
        assert train_steps(ddp, opt2, BATCHES[3:5], scheduler=sched2, scaler=scaler2) == expected
        ddp_path = tmp_path / "from_ddp.pt"
        dr.save_checkpoint(ddp_path, model=ddp, optimizer=opt2, scheduler=sched2, scaler=scaler2, step=5)
    assert_same(net2.state_dict(), net.state_dict())
    saved = torch.load(ddp_path, weights_only=True)
    assert not any(k.startswith("module.") for k in saved[Key.MODEL])
    net3, model3, opt3, sched3, scaler3 = _setup(seed=11)
    dr.resume(ddp_path, model=model3, optimizer=opt3, scheduler=sched3, scaler=scaler3)
    assert_same(net3.state_dict(), net.state_dict())
    assert_same(opt3.state_dict()["state"], opt.state_dict()["state"])


@pytest.mark.parametrize("src_kind", ["plain", "dp", "compiled", "dp_compile"])
@pytest.mark.parametrize("dst_kind", ["plain", "dp", "compiled", "compile_dp", "dp_dp"])
def test_toolkit_file_from_any_wrapping_into_any_wrapping(tmp_path, src_kind, dst_kind):
    path, (net, _, opt, sched, scaler) = _trained_checkpoint(tmp_path, kind=src_kind)
    net2, model2, opt2, sched2, scaler2 = _setup(seed=4, kind=dst_kind)
    dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert_same(net2.state_dict(), net.state_dict())
    assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])
    dr.check_devices(model2, opt2)


# ---------------------------------------------------------------- foreign layouts


def _foreign(net, opt, layout, prefix):
    sd = {prefix + k: v for k, v in net.state_dict().items()}
    osd = opt.state_dict()
    return {
        "bare": sd,
        "model_optimizer": {"model": sd, "optimizer": osd, "epoch": 2, "step": 30},
        "state_dict": {"state_dict": sd, "optimizer_states": [osd], "epoch": 2, "global_step": 30},
        "model_state_dict": {"model_state_dict": sd, "optimizer_state_dict": osd, "epoch": 2},
    }[layout]


@pytest.mark.parametrize("layout", ["bare", "model_optimizer", "state_dict", "model_state_dict"])
@pytest.mark.parametrize("prefix", ["", "module."])
@pytest.mark.parametrize("dst_kind", ["plain", "dp", "compiled"])
def test_foreign_layouts(tmp_path, layout, prefix, dst_kind):
    net = TinyNet(seed=1)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)  # a positional optimizer, as most scripts
    train_steps(net, opt, BATCHES[:2])
    path = tmp_path / f"{layout}.pth"
    torch.save(_foreign(net, opt, layout, prefix), path)

    net2 = TinyNet(seed=2)
    model2 = wrap(net2, dst_kind)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    if layout == "bare":
        with pytest.raises(dr.errors.StateMismatchError, match="has no optimizer state"):
            dr.resume(path, model=model2, optimizer=opt2)
        res = dr.resume(path, model=model2)
        assert res.restored == ("model",) and res.layout is dr.Layout.BARE
        assert_same(net2.state_dict(), net.state_dict())
    else:
        res = dr.resume(path, model=model2, optimizer=opt2)
        assert res.restored == ("model", "optimizer")
        assert res.epoch == 2 and res.step == (None if layout == "model_state_dict" else 30)
        assert_same(net2.state_dict(), net.state_dict())
        assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])
        dr.check_devices(model2, opt2)
        assert train_steps(net2, opt2, BATCHES[2:4]) == train_steps(net, opt, BATCHES[2:4])


def test_gpu_saved_file_resumes_into_a_cpu_model(tmp_path):
    path, (net, model, opt, sched, scaler) = _trained_checkpoint(tmp_path)
    obj = torch.load(path, weights_only=True)
    gpu_path = tmp_path / "gpu.pt"
    save_with_device_tag(obj, gpu_path, tag="cuda:1")
    for mmap in (True, False):
        net2, model2, opt2, sched2, scaler2 = _setup(seed=9)
        dr.resume(
            gpu_path,
            model=model2,
            optimizer=opt2,
            scheduler=sched2,
            scaler=scaler2,
            options=dr.ResumeOptions(mmap=mmap),
        )
        assert_same(net2.state_dict(), net.state_dict())
        assert_same(opt2.state_dict()["state"], opt.state_dict()["state"])
        dr.check_devices(model2, opt2)


def test_reordered_modules_get_the_right_state(tmp_path):
    model = TwinNet(seed=1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train_steps(model, opt, [(x[:, :3], torch.cat([y, y[:, :1]], 1)) for x, y in BATCHES[:2]])
    path = tmp_path / "twins.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt)
    target = TwinNetReordered(seed=2)
    live = torch.optim.Adam(target.parameters(), lr=1e-2)
    dr.resume(path, model=target, optimizer=live)
    for name, p in target.named_parameters():
        assert_same(dict(live.state[p]), dict(opt.state[dict(model.named_parameters())[name]]), name)


# ---------------------------------------------------------------- memory map, devices, result


def _mapped_ranges(path):
    with open("/proc/self/maps") as f:
        return [
            tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f if line.rstrip().endswith(str(path))
        ]


@pytest.mark.parametrize("opt_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_state_does_not_alias_the_mapped_file(tmp_path, opt_cls):
    kwargs = {"momentum": 0.9} if opt_cls is torch.optim.SGD else {}
    net = TinyNet()
    opt = opt_cls(net.parameters(), lr=1e-2, **kwargs)
    train_steps(net, opt, BATCHES[:2])
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=net, optimizer=opt)
    expected = torch.load(path, weights_only=True)[Key.OPTIMIZER]["state"]

    net2 = TinyNet(seed=2)
    opt2 = opt_cls(net2.parameters(), lr=1e-2, **kwargs)
    dr.resume(path, model=net2, optimizer=opt2, options=dr.ResumeOptions(mmap=True))
    ranges = _mapped_ranges(path) if os.path.exists("/proc/self/maps") else []
    for state in opt2.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                ptr = value.data_ptr()
                assert not any(a <= ptr < b for a, b in ranges), key
                value.add_(1000)  # modify the live state in place
    reloaded = torch.load(path, weights_only=True)[Key.OPTIMIZER]["state"]
    assert_same(reloaded, expected)  # the file never changed
    for p in net2.parameters():
        assert not any(a <= p.data_ptr() < b for a, b in ranges)
    dr.check_devices(net2, opt2)


def test_resume_result_fields(tmp_path):
    path, _ = _trained_checkpoint(tmp_path)
    net2, model2, opt2, sched2, scaler2 = _setup(seed=5)
    res = dr.resume(str(path), model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    assert isinstance(res, dr.ResumeResult)
    assert res.path == path and res.layout is dr.Layout.TOOLKIT
    assert (res.step, res.epoch, res.extra) == (3, 0, {"note": "hi"})
    assert res.metadata["world_size"] == 1 and res.metadata["optimizer_class"] == "AdamW"
    assert {"model", "optimizer", "scheduler", "scaler"} <= set(res.restored)
    assert res.skipped == () and res.missing_keys == [] and res.unexpected_keys == []


def test_map_location_override(tmp_path):
    path, (net, *_) = _trained_checkpoint(tmp_path)
    for kwargs in ({"map_location": "cpu", "mmap": False}, {"map_location": dr.rank_map_location()}):
        net2, model2, opt2, sched2, scaler2 = _setup(seed=5)
        dr.resume(
            path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, options=dr.ResumeOptions(**kwargs)
        )
        assert_same(net2.state_dict(), net.state_dict())


# ---------------------------------------------------------------- strict=False


def test_strict_false_restores_what_fits_and_reports_the_rest(tmp_path):
    net = TinyNet(seed=1)
    sd = {"module." + k: v for k, v in net.state_dict().items() if not k.startswith("head.")}
    sd["module.old_head.weight"] = torch.zeros(2, 3)
    path = tmp_path / "partial.pt"
    torch.save({"model": sd, "epoch": 1}, path)

    net2, model2, opt2, sched2, scaler2 = _setup(seed=2)
    frozen = snapshot(net2, opt2, sched2, scaler2)
    with pytest.raises(dr.errors.KeyMismatchError):
        dr.resume(path, model=model2)
    res = dr.resume(
        path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, options=dr.ResumeOptions(strict=False)
    )
    assert res.restored == ("model",)
    assert set(res.skipped) == {"optimizer", "scheduler", "scaler", "rng"}
    assert sorted(res.missing_keys) == ["head.bias", "head.weight"]
    assert res.unexpected_keys == ["module.old_head.weight"]
    assert torch.equal(net2.fc.weight, net.fc.weight)
    assert_same(net2.head.weight, frozen["model"]["head.weight"])
    assert_same(opt2.state_dict(), frozen["optimizer"])
    assert_same(sched2.state_dict(), frozen["scheduler"])


def test_strict_false_casts_floating_dtypes(tmp_path):
    net = TinyNet(seed=1).double()
    path = tmp_path / "double.pt"
    dr.save_checkpoint(path, model=net)
    net2 = TinyNet(seed=2)
    with pytest.raises(dr.errors.KeyMismatchError, match="dtypes differ"):
        dr.resume(path, model=net2)
    dr.resume(path, model=net2, options=dr.ResumeOptions(strict=False))
    assert net2.fc.weight.dtype == torch.float32
    assert torch.equal(net2.fc.weight, net.fc.weight.float())


def test_disabled_scaler_state_into_an_enabled_scaler(tmp_path):
    path, _ = _trained_checkpoint(tmp_path, scaler_enabled=False)
    assert torch.load(path, weights_only=True)[Key.SCALER] == {}
    net2, model2, opt2, sched2, scaler2 = _setup(seed=2)
    frozen = scaler2.state_dict()
    with pytest.raises(dr.errors.StateMismatchError, match="disabled scaler"):
        dr.resume(path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2)
    res = dr.resume(
        path, model=model2, optimizer=opt2, scheduler=sched2, scaler=scaler2, options=dr.ResumeOptions(strict=False)
    )
    assert "scaler" in res.skipped and scaler2.state_dict() == frozen
    # a disabled scaler ignores any state: nothing of it is restored, and the log does not say it was
    net3, model3, opt3, sched3, scaler3 = _setup(seed=2, scaler_enabled=False)
    res = dr.resume(path, model=model3, optimizer=opt3, scheduler=sched3, scaler=scaler3)
    assert "scaler" in res.skipped and "scaler" not in res.restored


def test_an_ordinary_resume_logs_one_line_of_what_was_restored(tmp_path, caplog):
    """What a user's loop sees on a plain resume: one INFO line; no hyperparameter notice for the lr the
    restored scheduler brings back, no scaler named when it is disabled, nothing at WARNING."""

    def run():
        model = TinyNet(0)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        sampler = dr.ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0)
        return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "dataloader": sampler}

    first = run()
    train_steps(first["model"], first["optimizer"], make_batches(2), scheduler=first["scheduler"])
    path = dr.save_checkpoint(tmp_path / "c.pt", step=2, **first)
    caplog.set_level(logging.DEBUG, logger="dist_resume")
    caplog.clear()
    result = dr.resume(path, **run())
    lines = [r for r in caplog.records if r.name == "dist_resume" and r.levelno >= logging.INFO]
    assert [r.levelname for r in lines] == ["INFO"], [r.getMessage() for r in lines]
    assert lines[0].getMessage().endswith("restored model, optimizer, scheduler, sampler, rng)")
    assert result.skipped == ("scaler",)
    assert any("lr: checkpoint" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)


# ---------------------------------------------------------------- all or nothing


def _payload(path):
    return torch.load(path, weights_only=True)


def _bad_files(tmp_path, good):
    """One file per kind of validation error, each derived from a valid checkpoint."""
    cases = {}

    def put(name, obj, error):
        p = tmp_path / f"bad_{name}.pt"
        torch.save(obj, p)
        cases[name] = (p, error)

    obj = _payload(good)
    del obj[Key.MODEL]["head.bias"]
    put("missing_key", obj, dr.errors.KeyMismatchError)
    obj = _payload(good)
    obj[Key.MODEL]["extra.weight"] = torch.zeros(1)
    put("unexpected_key", obj, dr.errors.KeyMismatchError)
    obj = _payload(good)
    obj[Key.MODEL]["fc.weight"] = torch.zeros(5, 4)
    put("shape", obj, dr.errors.KeyMismatchError)
    obj = _payload(good)
    obj[Key.MODEL]["fc.weight"] = obj[Key.MODEL]["fc.weight"].double()
    put("dtype", obj, dr.errors.KeyMismatchError)
    obj = _payload(good)
    obj[Key.OPTIMIZER]["param_groups"].append(dict(obj[Key.OPTIMIZER]["param_groups"][0], params=[]))
    put("group_count", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    group = obj[Key.OPTIMIZER]["param_groups"][0]
    group["params"], group["param_names"] = group["params"][:-1], group["param_names"][:-1]
    put("group_size", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    obj[Key.META]["optimizer_class"] = "SGD"
    put("optimizer_class", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    obj[Key.OPTIMIZER]["state"][0]["exp_avg"] = torch.zeros(4, 3)
    put("state_shape", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    obj[Key.OPTIMIZER]["param_groups"][0]["param_names"][0] = "renamed.weight"
    put("param_names", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    obj[Key.SCHEDULER] = torch.optim.lr_scheduler.OneCycleLR(
        torch.optim.SGD(TinyNet().parameters(), lr=0.1), max_lr=0.1, total_steps=10
    ).state_dict()
    put("scheduler_class", obj, dr.errors.StateMismatchError)
    obj = _payload(good)
    obj[Key.SCALER] = {}
    put("empty_scaler", obj, dr.errors.StateMismatchError)
    obj = _payload(good)
    del obj[Key.OPTIMIZER]
    put("no_optimizer", obj, dr.errors.StateMismatchError)
    obj = _payload(good)
    del obj[Key.SCHEDULER]
    put("no_scheduler", obj, dr.errors.StateMismatchError)
    obj = _payload(good)
    del obj[Key.SCALER]
    put("no_scaler", obj, dr.errors.StateMismatchError)
    obj = _payload(good)
    obj[Key.OPTIMIZER] = {"not": "an optimizer"}
    put("optimizer_entry", obj, dr.errors.OptimizerStateMismatchError)
    obj = _payload(good)
    obj[Key.SCHEDULER] = [1, 2]
    put("scheduler_entry", obj, dr.errors.StateMismatchError)
    truncated = tmp_path / "bad_truncated.pt"
    truncated.write_bytes(good.read_bytes()[:-100])
    cases["truncated"] = (truncated, dr.errors.CheckpointCorruptError)
    obj = _payload(good)
    put("foreign_unknown", {"weights": obj[Key.MODEL], "best": dict(obj[Key.MODEL])}, dr.errors.NotACheckpointError)
    return cases


def test_failed_resume_changes_nothing(tmp_path):
    good, _ = _trained_checkpoint(tmp_path)
    cases = _bad_files(tmp_path, good)
    # live objects that have trained on their own, so "unchanged" is not "fresh"
    net, model, opt, sched, scaler = _setup(seed=6, kind="dp")
    train_steps(model, opt, BATCHES[3:5], scheduler=sched, scaler=scaler)
    frozen = snapshot(model, opt, sched, scaler)
    for name, (path, error) in cases.items():
        with pytest.raises(error) as info:
            dr.resume(path, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
        assert str(path) in str(info.value), name
        assert_same(snapshot(model, opt, sched, scaler), frozen, name)
    # and the same objects still resume from the good file
    dr.resume(good, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    with pytest.raises(AssertionError):
        assert_same(snapshot(model, opt, sched, scaler), frozen)


def test_error_messages_name_what_and_where(tmp_path):
    good, _ = _trained_checkpoint(tmp_path)
    cases = _bad_files(tmp_path, good)
    net, model, opt, sched, scaler = _setup(seed=6)

    def message(name):
        with pytest.raises(cases[name][1]) as info:
            dr.resume(cases[name][0], model=model, optimizer=opt, scheduler=sched, scaler=scaler)
        return str(info.value)

    assert "missing from checkpoint (1: 'head.bias')" in message("missing_key")
    assert "unexpected in checkpoint (1: 'extra.weight')" in message("unexpected_key")
    assert "fc.weight: checkpoint (5, 4), model (3, 4)" in message("shape")
    assert "fc.weight: checkpoint torch.float64, model torch.float32" in message("dtype")
    assert "saved from SGD, this optimizer is AdamW" in message("optimizer_class")
    assert "state[fc.weight]['exp_avg'] has shape (4, 3), the parameter (3, 4)" in message("state_shape")
    assert "renamed.weight" in message("param_names") and "fc.weight" in message("param_names")
    assert "StepLR" in message("scheduler_class")
    assert "has no optimizer state" in message("no_optimizer") and "allow_missing=('optimizer',)" in message(
        "no_optimizer"
    )


def test_a_failure_while_applying_rolls_back(tmp_path, monkeypatch):
    """Validation cannot foresee everything: if the model load itself fails, the other parts are rolled back."""
    good, _ = _trained_checkpoint(tmp_path)
    net, model, opt, sched, scaler = _setup(seed=6)
    train_steps(model, opt, BATCHES[3:5], scheduler=sched, scaler=scaler)
    frozen = snapshot(model, opt, sched, scaler)

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure inside load_state_dict")

    monkeypatch.setattr(model, "load_state_dict", broken)
    with pytest.raises(RuntimeError, match="simulated"):
        dr.resume(good, model=model, optimizer=opt, scheduler=sched, scaler=scaler)
    monkeypatch.undo()
    assert_same(snapshot(model, opt, sched, scaler), frozen)
