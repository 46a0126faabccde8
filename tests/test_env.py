"""rank_info / rank_device / init_distributed from torchrun's environment variables."""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import dist_resume as dr
from tests.accelerator import Accel, on_accelerators
from tests.helpers import fake_accelerator


def test_single_process_defaults(env):
    info = dr.rank_info()
    assert info == dr.RankInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0)
    assert info.is_distributed is False
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.rank = 1  # type: ignore[misc]


def test_reads_torchrun_variables_second_node(env):
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    info = dr.rank_info()
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size, info.node_rank) == (3, 1, 4, 2, 1)
    assert info.is_distributed


def test_without_local_rank_one_node_is_assumed(env):
    env(RANK=1, WORLD_SIZE=2)  # mp.spawn style
    info = dr.rank_info()
    assert (info.local_rank, info.local_world_size) == (1, 2)


def test_local_world_size_defaults_to_world_size(env):
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=3)
    assert dr.rank_info().local_world_size == 3


def test_empty_values_count_as_unset(env):
    env(RANK="", WORLD_SIZE=" ")
    assert dr.rank_info().world_size == 1


@pytest.mark.parametrize(
    "values, words",
    [
        (dict(RANK="zero"), ["RANK='zero'", "not an integer"]),
        (dict(WORLD_SIZE="2.0"), ["WORLD_SIZE='2.0'", "not an integer"]),
        (dict(RANK=2, WORLD_SIZE=2), ["RANK=2", "WORLD_SIZE=2"]),
        (dict(RANK=1), ["RANK=1", "WORLD_SIZE=1"]),
        (dict(RANK=-1, WORLD_SIZE=2), ["RANK=-1"]),
        (dict(RANK=0, WORLD_SIZE=4, LOCAL_RANK=2, LOCAL_WORLD_SIZE=2), ["LOCAL_RANK=2", "LOCAL_WORLD_SIZE=2"]),
        (dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, LOCAL_WORLD_SIZE=4), ["LOCAL_WORLD_SIZE=4", "WORLD_SIZE=2"]),
        (dict(WORLD_SIZE=0), ["WORLD_SIZE=0", "at least 1"]),
        (dict(RANK=0, WORLD_SIZE=2, GROUP_RANK=-1), ["GROUP_RANK=-1"]),
    ],
)
def test_inconsistent_values_raise_a_clear_error(env, values, words):
    env(**values)
    with pytest.raises(dr.errors.EnvironmentMismatchError) as info:
        dr.rank_info()
    for word in words:
        assert word in str(info.value)
    assert isinstance(info.value, ValueError)


def test_no_env_var_leaks_between_tests(env):
    import os

    assert not any(name in os.environ for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


# ---------------------------------------------------------------- rank_device
# torch.accelerator is faked (tests.helpers.fake_accelerator) for the types this machine cannot have; the
# PrivateUse1 cases run on the real test accelerator (the accelerator and sim_accelerator fixtures).


def test_rank_device_is_cpu_without_an_accelerator(env, monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    assert dr.rank_device() == torch.device("cpu")
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    assert dr.rank_device() == torch.device("cpu")


@pytest.mark.parametrize("device_type", ["cuda", "xpu", "hpu", "mtia"])
def test_rank_device_is_the_accelerator_at_local_rank_never_rank(env, monkeypatch, device_type):
    fake_accelerator(monkeypatch, device_type, count=2)
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    assert dr.rank_device() == torch.device(device_type, 1)  # global rank 3 would be "invalid device ordinal"
    assert dr.rank_device(0) == torch.device(device_type, 0)
    assert dr.rank_map_location() == torch.device(device_type, 1)


@on_accelerators(2)
def test_rank_device_on_a_real_accelerator_is_local_rank_never_rank(env, accelerator: Accel):
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    assert dr.rank_device() == accelerator.device(1) == dr.rank_map_location()
    assert dr.rank_device(0) == accelerator.device(0) and dr.rank_map_location(0) == accelerator.device(0)
    assert torch.ones(1, device=dr.rank_device()).device == accelerator.device(1)  # a device torch can use
    with pytest.raises(
        dr.errors.EnvironmentMismatchError, match=rf"{accelerator.count} visible {accelerator.type} device"
    ):
        dr.rank_device(accelerator.count)


@pytest.mark.parametrize(
    "device_type, variable, value",
    [
        ("cuda", "CUDA_VISIBLE_DEVICES", "4,5"),
        ("xpu", "ZE_AFFINITY_MASK", "0.0,0.1"),
        ("hpu", "HABANA_VISIBLE_MODULES", "2,3"),
    ],
)
def test_rank_device_rejects_local_rank_beyond_the_visible_devices(env, monkeypatch, device_type, variable, value):
    fake_accelerator(monkeypatch, device_type, count=2)
    monkeypatch.setenv(variable, value)
    env(RANK=2, LOCAL_RANK=2, WORLD_SIZE=3, LOCAL_WORLD_SIZE=3)
    with pytest.raises(dr.errors.EnvironmentMismatchError) as info:
        dr.rank_device()
    msg = str(info.value)
    assert "LOCAL_RANK=2" in msg and f"2 visible {device_type} device(s)" in msg and "nproc_per_node" in msg
    assert f"{variable}={value}" in msg
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        dr.rank_device(5)
    with pytest.raises(dr.errors.EnvironmentMismatchError, match="negative"):
        dr.rank_device(-1)


def test_rank_device_names_an_unset_visible_devices_variable(env, monkeypatch):
    fake_accelerator(monkeypatch, "cuda", count=1)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    with pytest.raises(
        dr.errors.EnvironmentMismatchError, match=r"1 visible cuda device\(s\) \(CUDA_VISIBLE_DEVICES=<unset>\)"
    ):
        dr.rank_device(1)


def test_mps_has_one_device_a_second_local_rank_is_an_error(env, monkeypatch):
    fake_accelerator(monkeypatch, "mps", count=1)
    assert dr.rank_device() == torch.device("mps", 0)
    env(RANK=1, LOCAL_RANK=1, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    with pytest.raises(dr.errors.EnvironmentMismatchError) as info:
        dr.rank_device()
    assert "LOCAL_RANK=1" in str(info.value) and "1 visible mps device(s) (no visible-devices variable)" in str(
        info.value
    )


# ---------------------------------------------------------------- init_distributed


@pytest.fixture
def recorded_init(monkeypatch):
    """dist.init_process_group replaced by a recorder: the backend init_distributed picks, nothing started."""
    calls: list[tuple[str, dict]] = []
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: calls.append((backend, kwargs)))
    return calls


def _available(monkeypatch, *names):
    monkeypatch.setattr(dist, "is_backend_available", lambda name: name in {"gloo", *names})


@pytest.mark.parametrize(
    "device_type, registered, backend",
    [
        ("cuda", ["nccl"], "nccl"),
        ("cuda", [], "gloo"),  # a torch build without NCCL
        ("xpu", ["xccl"], "xccl"),
        ("hpu", ["hccl"], "hccl"),  # Habana's bridge registers hccl
        ("mps", [], "gloo"),  # torch's own default map
    ],
)
def test_init_distributed_sets_the_device_and_picks_its_backend(
    env, monkeypatch, recorded_init, device_type, registered, backend
):
    fake = fake_accelerator(monkeypatch, device_type, count=1 if device_type == "mps" else 2)
    _available(monkeypatch, *registered)
    if device_type == "mps":  # one device per Mac: two nodes of one process each
        env(RANK=1, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=1, GROUP_RANK=1)
    else:
        env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    info = dr.init_distributed()
    assert fake.set_index == [torch.device(device_type, info.local_rank)] and fake.current == info.local_rank
    assert [b for b, _ in recorded_init] == [backend]
    assert recorded_init[0][1]["world_size"] == info.world_size and recorded_init[0][1]["rank"] == info.rank


@pytest.mark.parametrize("registered", [True, False])
def test_a_privateuse1_device_gets_the_backend_its_plugin_registered_else_gloo_and_one_warning(
    env, monkeypatch, recorded_init, caplog, sim_accelerator: Accel, registered
):
    # the test accelerator registers simgloo for "sim" (Backend.register_backend(..., devices=["sim"])): torch's
    # default map then names it; without that registration nothing serves sim tensors
    assert dist.Backend.default_device_backend_map["sim"] == "simgloo"
    if not registered:
        monkeypatch.delitem(dist.Backend.default_device_backend_map, "sim")
    for rank in (0, 1):
        env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
        with caplog.at_level(logging.WARNING, logger="dist_resume"):
            info = dr.init_distributed()
        assert info.local_rank == rank and torch.accelerator.current_device_index() == rank  # the real device
        assert recorded_init[-1][1]["rank"] == rank and recorded_init[-1][1]["world_size"] == 2
    warned = [r.getMessage() for r in caplog.records if "no backend registered" in r.getMessage()]
    assert [b for b, _ in recorded_init] == ["simgloo" if registered else "gloo"] * 2
    if registered:
        assert warned == []
    else:
        assert len(warned) == 1 and "for sim tensors; using gloo" in warned[0]  # rank 0 only


def test_init_distributed_keeps_an_explicit_backend(env, monkeypatch, recorded_init):
    fake_accelerator(monkeypatch, "cuda", count=2)
    _available(monkeypatch, "nccl")
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=2, LOCAL_WORLD_SIZE=2)
    dr.init_distributed(backend="cpu:gloo,cuda:nccl")
    assert [b for b, _ in recorded_init] == ["cpu:gloo,cuda:nccl"]


def test_the_backend_table(monkeypatch):
    from dist_resume._dist.accelerator import backend_for

    _available(monkeypatch, "nccl", "xccl", "hccl")
    assert [backend_for(t) for t in ("cpu", "cuda", "xpu", "npu", "hpu", "mps")] == [
        "gloo",
        "nccl",
        "xccl",
        "hccl",  # torch_npu registers hccl when imported
        "hccl",
        "gloo",
    ]
    monkeypatch.setitem(dist.Backend.default_device_backend_map, "mtia", "fake")
    assert backend_for("mtia") == "gloo"  # torch's test backend claims devices it cannot drive


def test_init_distributed_is_a_no_op_for_a_plain_process(env, monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    info = dr.init_distributed()
    assert info == dr.RankInfo()
    assert not dist.is_initialized()  # no process group for a single process started without a launcher
    assert dr.init_distributed(backend="gloo") == info  # idempotent
    assert not dist.is_initialized()
    dr.destroy_distributed()  # nothing to destroy: a no-op
    assert not dist.is_initialized()


def test_init_distributed_makes_a_group_of_one_under_torchrun(env, monkeypatch):
    # torchrun --nproc_per_node=1 without its agent: this process hosts the store (MASTER_PORT=0: any free port)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=0)
    env(TORCHELASTIC_RUN_ID="test", TORCHELASTIC_RESTART_COUNT=0)
    try:
        info = dr.init_distributed(timeout=timedelta(seconds=30))
        assert info.world_size == 1 and not info.is_distributed  # no other rank, yet a group exists
        assert dist.is_initialized() and dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        assert dr.init_distributed() == info  # idempotent
    finally:
        dr.destroy_distributed()
    assert not dist.is_initialized()
    dr.destroy_distributed()  # twice is fine


def test_the_env_rendezvous_variables_count_as_launched(env, monkeypatch, recorded_init):
    from dist_resume._dist.env import launched

    assert not launched()
    env(RANK=0, WORLD_SIZE=1, MASTER_ADDR="127.0.0.1")
    assert not launched()  # MASTER_PORT missing: a half-set environment is no launcher
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")
    assert launched()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    env(MASTER_PORT=29500)
    assert launched()


def test_init_distributed_returns_at_once_under_an_existing_group(env, tmp_path):
    from tests.models import single_rank_group

    with single_rank_group(tmp_path):
        info = dr.init_distributed()
        assert info.world_size == 1 and info.rank == 0
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_destroy_distributed_ends_a_group_the_script_made_itself(env, tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dr.destroy_distributed()
    assert not dist.is_initialized()


def test_init_distributed_rejects_inconsistent_env_before_anything(env):
    env(RANK=2, WORLD_SIZE=2)
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        dr.init_distributed()
    assert not dist.is_initialized()
