"""rank_info / rank_device / init_distributed from torchrun's environment variables."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import dist_resume as dr


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


def test_rank_device_is_cpu_without_cuda(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dr.rank_device() == torch.device("cpu")
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2)
    assert dr.rank_device() == torch.device("cpu")


def test_rank_device_uses_local_rank_never_rank(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env(RANK=3, LOCAL_RANK=1, WORLD_SIZE=4, LOCAL_WORLD_SIZE=2, GROUP_RANK=1)
    assert dr.rank_device() == torch.device("cuda", 1)  # global rank 3 would be "invalid device ordinal"
    assert dr.rank_device(0) == torch.device("cuda", 0)


def test_rank_device_rejects_local_rank_beyond_the_visible_gpus(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    env(RANK=2, LOCAL_RANK=2, WORLD_SIZE=3, LOCAL_WORLD_SIZE=3)
    with pytest.raises(dr.errors.EnvironmentMismatchError) as info:
        dr.rank_device()
    msg = str(info.value)
    assert (
        "LOCAL_RANK=2" in msg
        and "2 visible CUDA device(s)" in msg
        and "CUDA_VISIBLE_DEVICES=4,5" in msg
        and "nproc_per_node" in msg
    )
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        dr.rank_device(5)
    with pytest.raises(dr.errors.EnvironmentMismatchError, match="negative"):
        dr.rank_device(-1)


def test_rank_map_location_follows_rank_device(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    env(RANK=5, LOCAL_RANK=3, WORLD_SIZE=8, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    assert dr.rank_map_location() == torch.device("cuda", 3)


# ---------------------------------------------------------------- init_distributed


def test_init_distributed_is_a_no_op_for_one_process(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    info = dr.init_distributed()
    assert info == dr.RankInfo()
    assert not dist.is_initialized()  # no process group for a single process
    assert dr.init_distributed(backend="gloo") == info  # idempotent
    assert not dist.is_initialized()


def test_init_distributed_with_world_size_one_from_torchrun(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=1)
    assert dr.init_distributed().world_size == 1
    assert not dist.is_initialized()


def test_init_distributed_returns_at_once_under_an_existing_group(env, tmp_path):
    from tests.models import single_rank_group

    with single_rank_group(tmp_path):
        info = dr.init_distributed()
        assert info.world_size == 1 and info.rank == 0
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_init_distributed_rejects_inconsistent_env_before_anything(env):
    env(RANK=2, WORLD_SIZE=2)
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        dr.init_distributed()
    assert not dist.is_initialized()
