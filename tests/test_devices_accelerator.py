"""check_devices, optimizer_to and torch's optimizer-state placement on a real accelerator: the seed bug in plain
torch, then prevented by resume and named by check_devices.

One body for the test accelerator (``sim``, every run) and CUDA (the multi-GPU job): the ``accelerator`` fixture.
A user's ``model.to(device)`` after building the optimizer keeps the Parameter objects on CUDA but not on a
PrivateUse1 device (FACTS 28), so the wrong order moves with ``accelerator.move`` (the same Parameters on both).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._layout.layout import Key
from tests.accelerator import Accel, on_accelerators
from tests.models import TinyNet, assert_same, batches_on, make_batches, state_devices, train_steps

CPU = torch.device("cpu")
BATCHES = make_batches(4)
SAME_DEVICE = "Expected all tensors to be on the same device"

OPTIMIZERS: dict[str, tuple[Callable[..., torch.optim.Optimizer], str]] = {
    "SGD(momentum=0.9)": (lambda params, **kw: torch.optim.SGD(params, lr=0.05, momentum=0.9, **kw), "momentum_buffer"),
    "Adam": (lambda params, **kw: torch.optim.Adam(params, lr=1e-2, **kw), "exp_avg"),
}


def _resume(
    path: str | os.PathLike[str], model: nn.Module, optimizer: torch.optim.Optimizer, **options: Any
) -> dr.ResumeResult:
    """The one call into resume: ``options`` are ``ResumeOptions`` fields."""
    return dr.resume(path, model=model, optimizer=optimizer, options=dr.ResumeOptions(**options))


def _trained_on_cpu(
    make: Callable[..., torch.optim.Optimizer], tmp_path: Path, **kwargs: Any
) -> tuple[nn.Module, torch.optim.Optimizer, Path]:
    """A CPU run of two steps and its checkpoint (what a file read with map_location='cpu' holds)."""
    net = TinyNet()
    opt = make(net.parameters(), **kwargs)
    train_steps(net, opt, BATCHES[:2])
    return net, opt, Path(dr.save_checkpoint(tmp_path / "ckpt.pt", model=net, optimizer=opt, step=2))


@pytest.mark.parametrize("foreach", [False, True], ids=["foreach=False", "foreach=True"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_seed_bug_in_plain_torch_and_how_the_toolkit_prevents_and_names_it(
    accelerator: Accel, tmp_path: Path, name: str, foreach: bool
) -> None:
    make, key = OPTIMIZERS[name]
    device = accelerator.device(0)
    src, src_opt, path = _trained_on_cpu(make, tmp_path, foreach=foreach)

    # plain torch, the wrong order: optimizer state loaded while the parameters are on the CPU, then model.to(device)
    net = TinyNet(seed=1)
    opt = make(net.parameters(), foreach=foreach)
    net.load_state_dict(src.state_dict())
    opt.load_state_dict(copy.deepcopy(src_opt.state_dict()))  # load_state_dict shares tensors (FACTS 33)
    weight = net.fc.weight
    accelerator.move(net)
    assert net.fc.weight is weight and weight.device == device  # the optimizer holds the live Parameter
    assert state_devices(opt, key) == {CPU}
    x, y = batches_on(BATCHES[2:3], device)[0]
    nn.functional.mse_loss(net(x), y).backward()
    with pytest.raises(RuntimeError, match=SAME_DEVICE) as raised:  # torch's own message, in torch's own kernel
        opt.step()
    assert str(device) in str(raised.value) and "cpu" in str(raised.value)

    # check_devices names the culprit and the fix; the fix it names works
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(net, opt)
    assert f"optimizer.state[fc.weight][{key!r}] is on cpu, its parameter on {device}" in str(info.value)
    assert "optimizer_to(optimizer)" in str(info.value)
    dr.optimizer_to(opt)
    dr.check_devices(net, opt)
    assert state_devices(opt, key) == {device} and state_devices(opt, "step") <= {CPU}
    opt.step()

    # the toolkit's order: model on the device, optimizer built, then resume
    net2 = TinyNet(seed=2).to(device)
    opt2 = make(net2.parameters(), foreach=foreach)
    assert _resume(path, net2, opt2).step == 2
    dr.check_devices(net2, opt2)
    assert state_devices(opt2, key) == {device} and state_devices(opt2, "step") <= {CPU}
    losses = train_steps(net2, opt2, batches_on(BATCHES[2:], device))
    assert losses == pytest.approx(train_steps(src, src_opt, BATCHES[2:]), rel=1e-4, abs=1e-6)

    # resume cannot foresee a later model.to(); check_devices catches it, and so does the first step after resume,
    # with the tensor and the fix instead of torch's message
    net3 = TinyNet(seed=3)
    opt3 = make(net3.parameters(), foreach=foreach)
    _resume(path, net3, opt3)
    accelerator.move(net3)
    with pytest.raises(dr.errors.DeviceMismatchError, match=f"is on cpu, its parameter on {device}"):
        dr.check_devices(net3, opt3)
    with pytest.raises(dr.errors.DeviceMismatchError) as first_step:
        train_steps(net3, opt3, batches_on(BATCHES[2:3], device))
    assert f"optimizer.state[fc.weight][{key!r}] is on cpu, its parameter on {device}" in str(first_step.value)
    assert "resume after model.to(device)" in str(first_step.value) and SAME_DEVICE not in str(first_step.value)
    dr.optimizer_to(opt3)  # the fix it names works; the check is gone once a step passed it
    train_steps(net3, opt3, batches_on(BATCHES[2:], device))
    assert not opt3._optimizer_step_pre_hooks


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_fused_and_capturable_step_lives_on_the_device(accelerator: Accel, tmp_path: Path, flag: str) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    flags: dict[str, Any] = {flag: True}
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, **flags)
    train_steps(net, opt, batches_on(BATCHES[:2], device))
    assert state_devices(opt, "step") == {device}  # torch's own placement (FACTS 2)
    path = dr.save_checkpoint(tmp_path / "ckpt.pt", model=net, optimizer=opt)
    saved_step = torch.load(path, weights_only=True, map_location="cpu")[Key.OPTIMIZER]["state"][0]["step"]
    assert saved_step.dtype == torch.float32

    # resume (the file read on the CPU) puts step back on the device, float32
    net2 = TinyNet(seed=1).to(device)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2, **flags)
    _resume(path, net2, opt2)
    for p in net2.parameters():
        assert opt2.state[p]["step"].device == device and opt2.state[p]["step"].dtype == torch.float32
    dr.check_devices(net2, opt2)
    expected = train_steps(net, opt, batches_on(BATCHES[2:], device))
    assert train_steps(net2, opt2, batches_on(BATCHES[2:], device)) == pytest.approx(expected, rel=1e-6, abs=1e-7)

    # optimizer_to after the wrong order: CPU state (step included) goes onto the device
    net3 = TinyNet(seed=2)
    opt3 = torch.optim.Adam(net3.parameters(), lr=1e-2, **flags)
    opt3.load_state_dict(torch.load(path, weights_only=True, map_location="cpu")[Key.OPTIMIZER])
    accelerator.move(net3)
    with pytest.raises(dr.errors.DeviceMismatchError, match=rf"\['step'\] is on cpu, its parameter on {device}"):
        dr.check_devices(net3, opt3)
    dr.optimizer_to(opt3)
    assert state_devices(opt3, "step") == {device} and state_devices(opt3, "exp_avg") == {device}
    dr.check_devices(net3, opt3)
    train_steps(net3, opt3, batches_on(BATCHES[2:3], device))


def test_plain_adam_step_stays_on_the_cpu_even_when_loaded_onto_the_device(
    accelerator: Accel, tmp_path: Path, env: Callable[..., None]
) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, batches_on(BATCHES[:2], device))
    path = dr.save_checkpoint(tmp_path / "ckpt.pt", model=net, optimizer=opt)

    net2 = TinyNet(seed=1).to(device)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    assert dr.rank_map_location() == device
    _resume(path, net2, opt2, map_location=dr.rank_map_location())  # every storage read onto the device
    assert state_devices(opt2, "step") == {CPU}  # not a device step: no host sync per parameter per step
    assert state_devices(opt2, "exp_avg") == {device}
    dr.check_devices(net2, opt2)

    # a device step on a plain Adam is reported, and optimizer_to moves it back
    for p in net2.parameters():
        opt2.state[p]["step"] = opt2.state[p]["step"].to(device)
    with pytest.raises(dr.errors.DeviceMismatchError, match=rf"\['step'\] is on {device}; torch keeps it on cpu"):
        dr.check_devices(net2, opt2)
    dr.optimizer_to(opt2)
    assert state_devices(opt2, "step") == {CPU}


def test_optimizer_to_copies_nothing_already_in_place(accelerator: Accel) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, batches_on(BATCHES[:1], device))
    before = {(id(p), k): v for p in net.parameters() for k, v in opt.state[p].items()}
    dr.optimizer_to(opt)
    dr.optimizer_to(opt, device)
    dr.optimizer_to(opt, accelerator.type)  # the bare type: the current device, where everything is
    after = {(id(p), k): v for p in net.parameters() for k, v in opt.state[p].items()}
    assert all(after[k] is v for k, v in before.items())


@on_accelerators(2)
def test_optimizer_to_an_explicit_device_and_back(accelerator: Accel) -> None:
    net = TinyNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train_steps(net, opt, BATCHES[:1])
    expected = {id(p): s["momentum_buffer"].clone() for p, s in opt.state.items()}
    dr.optimizer_to(opt, accelerator.device(1))
    assert state_devices(opt, "momentum_buffer") == {accelerator.device(1)}
    dr.optimizer_to(opt)  # back onto the params' device
    assert state_devices(opt, "momentum_buffer") == {CPU}
    assert all(torch.equal(s["momentum_buffer"], expected[id(p)]) for p, s in opt.state.items())


def test_check_devices_catches_a_cpu_exp_avg_and_a_cpu_batch(accelerator: Accel) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, batches_on(BATCHES[:1], device))
    dr.check_devices(net, opt)
    opt.state[net.submodule.weight]["exp_avg"] = opt.state[net.submodule.weight]["exp_avg"].cpu()
    report = dr.tools.device_report(net, opt)
    assert report == [f"optimizer.state[submodule.weight]['exp_avg'] is on cpu, its parameter on {device}"]
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(nn.DataParallel(net), opt)  # named without the wrapper's module. prefix
    assert info.value.findings == report
    assert dr.tools.device_report(net, batch=BATCHES[0]) == [
        f"batch[0] is on cpu, the model on {device}",
        f"batch[1] is on cpu, the model on {device}",
    ]


def test_a_device_saved_file_resumes_into_a_cpu_model(accelerator: Accel, tmp_path: Path) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, batches_on(BATCHES[:2], device))
    path = dr.save_checkpoint(tmp_path / "device.pt", model=net, optimizer=opt, step=2)

    cpu_net = TinyNet(seed=1)
    cpu_opt = torch.optim.AdamW(cpu_net.parameters(), lr=1e-2)
    assert _resume(path, cpu_net, cpu_opt).step == 2
    assert all(t.device == CPU for t in cpu_net.state_dict().values())
    assert state_devices(cpu_opt, "exp_avg") == {CPU} and state_devices(cpu_opt, "step") == {CPU}
    dr.check_devices(cpu_net, cpu_opt)
    assert_same(cpu_net.state_dict(), {k: v.cpu() for k, v in net.state_dict().items()})
    train_steps(cpu_net, cpu_opt, BATCHES[2:])
