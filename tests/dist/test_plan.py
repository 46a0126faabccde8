"""Broadcast resume validates once per rank: the plan built before the data moves is the one applied (2-rank gloo)."""

from __future__ import annotations

import pytest
import torch

import dist_resume
from tests.dist import ddp_workers as W
from tests.dist import plan_workers as PW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_broadcast_resume_validates_once_on_every_rank(tmp_path):
    ckpt = tmp_path / "c.pt"
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=2, seed=1)
    dist_resume.save_checkpoint(ckpt, model=model, optimizer=opt, scheduler=sched, step=2)
    expected = W.flat_state(model, opt)
    results = run_ranks(PW.count_validations, 2, tmp_path=tmp_path, args=(str(ckpt),), deadline=120, pg_timeout=60)
    for rank, res in enumerate(results):
        assert res["calls"] == {
            "plan_restore": 1,
            "adapt_state_dict": 1,
            "prepare_optimizer_state": 1,
            "check_scheduler": 1,
        }, f"rank {rank}: {res['calls']}"
        assert res["restored"] == ("model", "optimizer", "scheduler", "rng")
        assert res["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(res["state"][key], value), (rank, key)
