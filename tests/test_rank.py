"""The one rank look-up: process group, then torchrun's RANK/WORLD_SIZE, then 0/1; every caller agrees."""

from __future__ import annotations

import logging

import pytest

import dist_resume as dr
from dist_resume._core import log as _log
from dist_resume._core.rank import global_rank, rank_and_world
from dist_resume._exact import rng as _rng
from tests.models import single_rank_group


def test_defaults_without_launcher(env):
    assert rank_and_world() == (0, 1) and global_rank() == 0


def test_torchrun_variables_before_a_group_exists(env):
    env(RANK=3, WORLD_SIZE=4)
    assert rank_and_world() == (3, 4)
    info = dr.rank_info()
    assert (info.rank, info.world_size) == (3, 4)
    assert dr.ResumableDistributedSampler(8, shuffle=False).num_replicas == 4


def test_process_group_wins_over_the_environment(env, tmp_path):
    env(RANK=3, WORLD_SIZE=4)  # stale values: the group is what collectives use
    with single_rank_group(tmp_path):
        assert rank_and_world() == (0, 1)
        info = dr.rank_info()
        assert (info.rank, info.world_size) == (0, 1)
        assert dr.seed_rng(5) == dr.derive_seed(5, 0)


@pytest.mark.parametrize("values", [dict(RANK="x"), dict(RANK=2, WORLD_SIZE=2), dict(WORLD_SIZE=0)])
def test_bad_values_raise_everywhere(env, values):
    env(**values)
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        rank_and_world()
    with pytest.raises(dr.errors.EnvironmentMismatchError):
        dr.rank_info()


def test_rank_seen_by_rng_and_log(env, caplog):
    env(RANK=1, WORLD_SIZE=2)
    assert dr.seed_rng(7) == dr.derive_seed(7, 1)
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        _log.log_rank0(logging.INFO, "only rank 0")
    assert "only rank 0" not in caplog.text
    assert _rng.rank_and_world is rank_and_world  # type: ignore[attr-defined]  # the one owner's, as rng imported it


def test_logging_never_raises_on_a_bad_rank(env, caplog):
    env(RANK="zero")
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        _log.log_rank0(logging.INFO, "logged as rank 0")
    assert "logged as rank 0" in caplog.text
