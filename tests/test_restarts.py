"""A script's own ``init_process_group`` under ``torchrun --max-restarts`` (FACTS 45): the first collective dist_resume
call warns once, on rank 0, naming both fixes, where the evidence shows the risk; nowhere else. The environment is
torchrun's (the variables its agent sets for each worker: torch/distributed/elastic/agent/server/
local_elastic_agent.py), the process groups are real one-rank gloo groups; no torchrun launch."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_resume as dr
from dist_resume._dist import checkin, restarts

RISKY = {"TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture
def own_group(tmp_path: Path) -> Iterator[Callable[[dist.Store], None]]:
    """``own_group(store)``: the script's own ``init_process_group("gloo", store=store, ...)``, destroyed after."""

    def make(store: dist.Store) -> None:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))

    assert not dist.is_initialized()
    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


def test_a_scripts_own_group_on_the_shared_agent_store_with_restarts_is_the_risk(tmp_path: Path, own_group) -> None:
    assert restarts.restart_risk(RISKY) is None  # no process group yet: nothing to say
    own_group(dist.FileStore(str(tmp_path / "store"), 1))  # the rendezvous store itself, as env:// gives it
    text = restarts.restart_risk(RISKY)
    assert text is not None and text.startswith("this job runs under torchrun --max-restarts 3")
    assert "dist_resume.init_distributed()" in text and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in text
    # no restarts allowed, or the agent's store not shared (what TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives): no risk
    for changed in ({"TORCHELASTIC_MAX_RESTARTS": "0"}, {"TORCHELASTIC_USE_AGENT_STORE": "False"}):
        assert restarts.restart_risk({**RISKY, **changed}) is None, changed
    assert restarts.restart_risk({}) is None  # not under torchrun


def test_a_group_rendezvoused_under_a_prefix_of_its_own_is_no_risk(tmp_path: Path, own_group) -> None:
    # FACTS 15's fix in a script: the store wrapped in a PrefixStore keyed by the restart count
    own_group(dist.PrefixStore("attempt_0", dist.FileStore(str(tmp_path / "store"), 1)))
    assert restarts.restart_risk(RISKY) is None


def test_init_distributeds_group_is_no_risk(env, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda check_available=False: None)
    env(RANK=0, LOCAL_RANK=0, WORLD_SIZE=1, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=0)
    env(TORCHELASTIC_RUN_ID="test", TORCHELASTIC_RESTART_COUNT=0)
    try:
        dr.init_distributed(timeout=timedelta(seconds=30))
        assert restarts.restart_risk(RISKY) is None
    finally:
        dr.destroy_distributed()


def test_the_first_collective_call_warns_once_on_rank_0(
    tmp_path: Path, own_group, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name, value in RISKY.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(restarts, "_looked", False)
    monkeypatch.setattr(checkin, "is_distributed", lambda: True)  # a one-rank group checks in as a job's would
    own_group(dist.FileStore(str(tmp_path / "store"), 1))
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        checkin.check_in("CheckpointManager.resume()")
        checkin.check_in("CheckpointManager.save(step=10)")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == [restarts.RESTART_RISK % 3], warned
