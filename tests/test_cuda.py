"""Real CUDA behaviour: the device bug users hit, step placement, rank-aware loading. Skipped without a GPU
(conftest); these run in the multi-GPU CI job."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._layout.layout import Key
from tests.models import TinyNet, assert_same, make_batches, train_steps

pytestmark = pytest.mark.cuda

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
BATCHES = make_batches(4)


def _on(batches, device):
    return [(x.to(device), y.to(device)) for x, y in batches]


def _adam_state_dict(**kwargs):
    """An Adam state dict saved from a CPU run (what a checkpoint usually holds after map_location='cpu')."""
    net = TinyNet()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, **kwargs)
    train_steps(net, opt, BATCHES[:2])
    return net.state_dict(), opt.state_dict()


def _state_devices(opt, key):
    return {opt.state[p][key].device for g in opt.param_groups for p in g["params"] if p in opt.state}


@pytest.mark.parametrize("foreach", [False, True])
def test_the_bug_users_hit_and_how_the_toolkit_prevents_and_catches_it(tmp_path, foreach):
    model_sd, opt_sd = _adam_state_dict()

    # plain torch, wrong order: optimizer state loaded while the params are on the CPU, then model.to("cuda")
    net = TinyNet(seed=1)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, foreach=foreach)
    net.load_state_dict(model_sd)
    opt.load_state_dict(copy.deepcopy(opt_sd))
    for group in opt.param_groups:
        group["foreach"] = foreach  # load_state_dict replaced it with the saved value
    weight = net.fc.weight
    net.to(CUDA)
    assert net.fc.weight is weight and weight.device.type == "cuda"  # same Parameter, moved in place
    assert _state_devices(opt, "exp_avg") == {CPU}
    x, y = _on(BATCHES[2:3], CUDA)[0]
    nn.functional.mse_loss(net(x), y).backward()
    with pytest.raises(RuntimeError, match="same device"):  # "Expected all tensors to be on the same device"
        opt.step()

    # check_devices names the culprit and the fix before the step
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(net, opt)
    msg = str(info.value)
    assert "optimizer.state[fc.weight]['exp_avg'] is on cpu, its parameter on cuda:0" in msg
    assert "optimizer_to(optimizer)" in msg
    dr.optimizer_to(opt)  # the fix it names
    dr.check_devices(net, opt)
    assert _state_devices(opt, "exp_avg") == {CUDA} and _state_devices(opt, "step") == {CPU}
    opt.step()

    # the toolkit's order: model on the device, optimizer built, then resume
    path = tmp_path / "ckpt.pt"
    src = TinyNet()
    src.load_state_dict(model_sd)
    src_opt = torch.optim.Adam(src.parameters(), lr=1e-2)
    src_opt.load_state_dict(copy.deepcopy(opt_sd))
    dr.save_checkpoint(path, model=src, optimizer=src_opt)
    net2 = TinyNet(seed=2).to(CUDA)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2, foreach=foreach)
    dr.resume(path, model=net2, optimizer=opt2)
    dr.check_devices(net2, opt2)
    assert _state_devices(opt2, "exp_avg") == {CUDA} and _state_devices(opt2, "step") == {CPU}
    losses = train_steps(net2, opt2, _on(BATCHES[2:], CUDA))
    expected = train_steps(src, src_opt, BATCHES[2:])
    assert losses == pytest.approx(expected, rel=1e-4, abs=1e-6)

    # resume cannot foresee a later model.to(); check_devices catches it
    net3 = TinyNet(seed=3)
    opt3 = torch.optim.Adam(net3.parameters(), lr=1e-2, foreach=foreach)
    dr.resume(path, model=net3, optimizer=opt3)
    net3.to(CUDA)
    with pytest.raises(dr.errors.DeviceMismatchError, match="is on cpu, its parameter on cuda:0"):
        dr.check_devices(net3, opt3)


@pytest.mark.parametrize("flag", ["fused", "capturable"])
def test_fused_and_capturable_step_lives_on_the_device(tmp_path, flag):
    net = TinyNet().to(CUDA)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, **{flag: True})
    train_steps(net, opt, _on(BATCHES[:2], CUDA))
    assert _state_devices(opt, "step") == {CUDA}  # torch's own placement
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=net, optimizer=opt)
    assert (
        torch.load(path, weights_only=True, map_location="cpu")[Key.OPTIMIZER]["state"][0]["step"].dtype
        == torch.float32
    )

    # resume (file read on the CPU) puts step back on the device, float32
    net2 = TinyNet(seed=1).to(CUDA)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2, **{flag: True})
    dr.resume(path, model=net2, optimizer=opt2)
    for g in opt2.param_groups:
        for p in g["params"]:
            assert opt2.state[p]["step"].device == p.device and opt2.state[p]["step"].dtype == torch.float32
    dr.check_devices(net2, opt2)
    expected = train_steps(net, opt, _on(BATCHES[2:], CUDA))
    assert train_steps(net2, opt2, _on(BATCHES[2:], CUDA)) == pytest.approx(expected, rel=1e-6, abs=1e-7)

    # optimizer_to after the wrong order: CPU state (step included) goes onto the device
    net3 = TinyNet(seed=2)
    opt3 = torch.optim.Adam(net3.parameters(), lr=1e-2, **{flag: True})
    opt3.load_state_dict(torch.load(path, weights_only=True, map_location="cpu")[Key.OPTIMIZER])
    net3.to(CUDA)
    with pytest.raises(dr.errors.DeviceMismatchError, match=r"\['step'\] is on cpu, its parameter on cuda:0"):
        dr.check_devices(net3, opt3)
    dr.optimizer_to(opt3)
    assert _state_devices(opt3, "step") == {CUDA} and _state_devices(opt3, "exp_avg") == {CUDA}
    dr.check_devices(net3, opt3)
    train_steps(net3, opt3, _on(BATCHES[2:3], CUDA))


def test_plain_adam_step_stays_on_cpu_even_when_loaded_onto_the_gpu(tmp_path):
    net = TinyNet().to(CUDA)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, _on(BATCHES[:2], CUDA))
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=net, optimizer=opt)

    net2 = TinyNet(seed=1).to(CUDA)
    opt2 = torch.optim.Adam(net2.parameters(), lr=1e-2)
    dr.resume(
        path, model=net2, optimizer=opt2, options=dr.ResumeOptions(map_location=dr.rank_map_location())
    )  # everything onto cuda:0
    assert _state_devices(opt2, "step") == {CPU}  # not a CUDA step: no host sync per parameter per step
    assert _state_devices(opt2, "exp_avg") == {CUDA}
    dr.check_devices(net2, opt2)

    # a CUDA step on a plain Adam is reported, and optimizer_to moves it back
    for p in net2.parameters():
        opt2.state[p]["step"] = opt2.state[p]["step"].to(CUDA)
    with pytest.raises(dr.errors.DeviceMismatchError, match=r"\['step'\] is on cuda:0; torch keeps it on cpu"):
        dr.check_devices(net2, opt2)
    dr.optimizer_to(opt2)
    assert _state_devices(opt2, "step") == {CPU}


def test_optimizer_to_copies_nothing_already_in_place():
    net = TinyNet().to(CUDA)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, _on(BATCHES[:1], CUDA))
    before = {(id(p), k): v for p in net.parameters() for k, v in opt.state[p].items()}
    dr.optimizer_to(opt)
    dr.optimizer_to(opt, "cuda")
    after = {(id(p), k): v for p in net.parameters() for k, v in opt.state[p].items()}
    assert all(after[k] is v for k, v in before.items())


def test_optimizer_to_explicit_device_and_back():
    net = TinyNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train_steps(net, opt, BATCHES[:1])
    dr.optimizer_to(opt, CUDA)
    assert _state_devices(opt, "momentum_buffer") == {CUDA}
    dr.optimizer_to(opt)  # back onto the params' device
    assert _state_devices(opt, "momentum_buffer") == {CPU}


def test_check_devices_catches_a_cpu_exp_avg_for_a_cuda_param():
    net = TinyNet().to(CUDA)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, _on(BATCHES[:1], CUDA))
    dr.check_devices(net, opt)
    opt.state[net.submodule.weight]["exp_avg"] = opt.state[net.submodule.weight]["exp_avg"].cpu()
    report = dr.tools.device_report(net, opt)
    assert report == ["optimizer.state[submodule.weight]['exp_avg'] is on cpu, its parameter on cuda:0"]
    with pytest.raises(dr.errors.DeviceMismatchError) as info:
        dr.check_devices(nn.DataParallel(net), opt)
    assert info.value.findings == report
    # and a batch left on the CPU
    assert dr.tools.device_report(net, batch=BATCHES[0]) == [
        "batch[0] is on cpu, the model on cuda:0",
        "batch[1] is on cpu, the model on cuda:0",
    ]


def test_gpu_saved_file_resumes_into_a_cpu_model(tmp_path):
    net = TinyNet().to(CUDA)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, _on(BATCHES[:2], CUDA))
    path = tmp_path / "gpu.pt"
    dr.save_checkpoint(path, model=net, optimizer=opt, step=2)

    cpu_net = TinyNet(seed=1)
    cpu_opt = torch.optim.AdamW(cpu_net.parameters(), lr=1e-2)
    assert dr.resume(path, model=cpu_net, optimizer=cpu_opt).step == 2
    assert all(t.device == CPU for t in cpu_net.state_dict().values())
    assert _state_devices(cpu_opt, "exp_avg") == {CPU} and _state_devices(cpu_opt, "step") == {CPU}
    dr.check_devices(cpu_net, cpu_opt)
    assert_same(cpu_net.state_dict(), {k: v.cpu() for k, v in net.state_dict().items()})
    train_steps(cpu_net, cpu_opt, BATCHES[2:])


def test_load_checkpoint_of_a_gpu_file_lands_on_the_rank_device(tmp_path, monkeypatch):
    path = tmp_path / "gpu.pt"
    torch.save({"w": torch.ones(3, device=CUDA)}, path)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert dr.load_checkpoint(path)["w"].device == CUDA
    assert dr.load_checkpoint(path, map_location="cpu")["w"].device == CPU


@pytest.mark.multigpu
def test_rank_aware_load_on_local_rank_1_allocates_nothing_on_cuda0(tmp_path, monkeypatch):
    path = tmp_path / "rank0_saved.pt"
    payload = {"w": torch.randn(1024, 1024, device="cuda:0"), "b": torch.randn(4096, device="cuda:0")}
    torch.save(payload, path)  # storages tagged cuda:0, as every file saved by rank 0 is
    del payload
    torch.cuda.synchronize(0)
    nbytes = 1024 * 1024 * 4

    # what happens without a map_location: the tensors come back on cuda:0
    before = torch.cuda.memory_allocated(0)
    plain = torch.load(path, weights_only=True)
    assert torch.cuda.memory_allocated(0) - before >= nbytes
    del plain
    torch.cuda.synchronize(0)

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    before0, before1 = torch.cuda.memory_allocated(0), torch.cuda.memory_allocated(1)
    for load in (
        lambda: dr.load_checkpoint(path, map_location=dr.rank_map_location(1)),
        lambda: dr.load_checkpoint(path),
    ):  # the default follows LOCAL_RANK
        loaded = load()
        assert loaded["w"].device == torch.device("cuda", 1) and loaded["b"].device == torch.device("cuda", 1)
        torch.cuda.synchronize(1)
        assert torch.cuda.memory_allocated(0) == before0  # nothing on cuda:0
        assert torch.cuda.memory_allocated(1) - before1 >= nbytes
        del loaded
        torch.cuda.synchronize(1)
    for mmap in (True, False):
        loaded = dr.load_checkpoint(path, map_location=dr.rank_map_location(1), mmap=mmap)
        assert torch.cuda.memory_allocated(0) == before0
        del loaded


@pytest.mark.multigpu
def test_resume_on_local_rank_1_keeps_cuda0_untouched(tmp_path):
    src = TinyNet().to("cuda:0")
    opt = torch.optim.Adam(src.parameters(), lr=1e-2)
    train_steps(src, opt, _on(BATCHES[:2], "cuda:0"))
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=src, optimizer=opt)
    torch.cuda.synchronize(0)
    before0 = torch.cuda.memory_allocated(0)
    dst = TinyNet(seed=1).to("cuda:1")
    dst_opt = torch.optim.Adam(dst.parameters(), lr=1e-2)
    dr.resume(path, model=dst, optimizer=dst_opt)
    assert torch.cuda.memory_allocated(0) == before0
    assert _state_devices(dst_opt, "exp_avg") == {torch.device("cuda", 1)}
    dr.check_devices(dst, dst_opt)
