"""device_report / check_devices: every misplaced tensor named in words a user can act on.

The meta device stands in for a second device on this CPU-only host.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dist_resume as dr
from tests.models import TinyNet, compile_module

META = torch.device("meta")


def _adam_with_state(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    opt = torch.optim.Adam(model.parameters(), **kwargs)
    for p in model.parameters():
        opt.state[p] = {"step": torch.tensor(2.0), "exp_avg": torch.zeros(p.shape), "exp_avg_sq": torch.zeros(p.shape)}
    return opt


def test_everything_in_place_reports_nothing():
    model = TinyNet()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 4)).sum().backward()
    opt.step()
    assert dr.tools.device_report(model, opt) == []
    assert dr.tools.device_report(model, opt, batch={"x": torch.ones(1), "y": [torch.ones(1)]}) == []
    dr.check_devices(model, opt)
    dr.check_devices(model)


def test_state_on_cpu_for_params_elsewhere_is_named_with_the_fix():
    model = TinyNet().to(META)  # "model.to('cuda') after the optimizer state was loaded"
    opt = _adam_with_state(model)
    report = dr.tools.device_report(model, opt)
    n_params = len(list(model.parameters()))
    assert len(report) == 2 * n_params  # exp_avg and exp_avg_sq for each; step belongs on the cpu
    assert "optimizer.state[fc.weight]['exp_avg'] is on cpu, its parameter on meta" in report
    assert "optimizer.state[submodule.weight]['exp_avg_sq'] is on cpu, its parameter on meta" in report
    assert not any("'step'" in line for line in report)

    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(model, opt)
    err = info.value
    assert err.findings == report
    msg = str(err)
    assert msg.startswith(f"{len(report)} tensor(s) on the wrong device")
    assert "optimizer.state[fc.weight]['exp_avg'] is on cpu, its parameter on meta" in msg
    assert "optimizer_to(optimizer)" in msg and "before building the optimizer" in msg
    assert f"and {len(report) - 10} more" in msg  # first ten, then a count
    assert isinstance(err, RuntimeError)  # still catchable as what torch raises

    dr.optimizer_to(opt)  # the fix it names works
    assert dr.tools.device_report(model, opt) == []


def test_names_are_canonical_under_wrappers():
    inner = TinyNet().to(META)
    opt = _adam_with_state(inner)
    for wrapped in (nn.DataParallel(inner), compile_module(inner), compile_module(nn.DataParallel(inner))):
        report = dr.tools.device_report(wrapped, opt)
        assert "optimizer.state[fc.weight]['exp_avg'] is on cpu, its parameter on meta" in report


def test_step_on_the_device_for_a_plain_group_is_reported():
    model = nn.Linear(2, 2).to(META)
    opt = _adam_with_state(model)
    dr.optimizer_to(opt)
    for p in model.parameters():
        opt.state[p]["step"] = torch.zeros((), device=META)
    report = dr.tools.device_report(model, opt)
    assert len(report) == 2
    assert report[0].startswith("optimizer.state[weight]['step'] is on meta; torch keeps it on cpu")


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_step_on_cpu_for_a_fused_or_capturable_group_is_reported(flag):
    model = nn.Linear(2, 2).to(META)
    opt = _adam_with_state(model, **{flag: True})
    report = dr.tools.device_report(model, opt)
    assert "optimizer.state[weight]['step'] is on cpu, its parameter on meta" in report
    dr.optimizer_to(opt)
    assert dr.tools.device_report(model, opt) == []


def test_torchs_own_fresh_placement_is_not_reported():
    """NAdam hosts `mu_product` (like `step`) on the CPU when not capturable: that is torch's choice, not a bug."""
    model = nn.Linear(3, 2, device=META)
    opt = torch.optim.NAdam(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # lazily creates the state where torch wants it
    assert opt.state[model.weight]["mu_product"].device.type == "cpu"
    assert opt.state[model.weight]["exp_avg"].device == META
    assert dr.tools.device_report(model, opt) == []
    dr.check_devices(model, opt)


def test_asgd_fresh_state_on_the_device_is_not_reported():
    # ASGD creates step, eta and mu on the parameter's device itself (it cannot step on meta, so set up by hand)
    model = nn.Linear(3, 2, device=META)
    opt = torch.optim.ASGD(model.parameters())
    for p in model.parameters():
        opt.state[p] = {
            "step": torch.zeros((), device=META),
            "eta": torch.ones((), device=META),
            "mu": torch.ones((), device=META),
            "ax": torch.zeros_like(p),
        }
    assert dr.tools.device_report(model, opt) == []


def test_param_not_in_model_is_described():
    model = nn.Linear(2, 2)
    stray = nn.Parameter(torch.zeros(5, device=META))
    opt = torch.optim.SGD([stray], lr=0.1, momentum=0.9)
    opt.state[stray] = {"momentum_buffer": torch.zeros(5)}
    (line,) = dr.tools.device_report(model, opt)
    assert "<parameter (5,) not in the model>" in line and "is on cpu, its parameter on meta" in line


def test_batch_on_another_device_is_named():
    model = TinyNet()
    batch = {"x": torch.ones(2, 4, device=META), "y": [torch.ones(2), (torch.ones(1, device=META),)]}
    report = dr.tools.device_report(model, batch=batch)
    assert report == ["batch['x'] is on meta, the model on cpu", "batch['y'][1][0] is on meta, the model on cpu"]
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(model, batch=batch)
    assert "batch.to(device)" in str(info.value) and "optimizer_to" not in str(info.value)
    assert dr.tools.device_report(model, batch=torch.ones(2, 4, device=META)) == ["batch is on meta, the model on cpu"]


def test_both_kinds_of_finding_get_both_fixes():
    model = nn.Linear(2, 2).to(META)
    opt = _adam_with_state(model)
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(model, opt, batch=torch.ones(1, 2))
    msg = str(info.value)
    assert "optimizer_to" in msg and "batch.to(device)" in msg
    assert "batch is on cpu, the model on meta" in msg
