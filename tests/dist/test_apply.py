"""Apply agrees across ranks: a failure on one rank puts every rank back and raises the same error (2-rank gloo)."""

from __future__ import annotations

import pytest

import dist_resume
from tests.dist import ddp_workers as W
from tests.dist import plan_workers as PW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_a_failure_on_one_rank_leaves_every_rank_unchanged(tmp_path):
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=2, seed=1)
    ckpt = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, step=2)
    with dist_resume.CheckpointManager(tmp_path / "run", model=model, optimizer=opt, scheduler=sched) as mgr:
        mgr.save(2)
    results = run_ranks(
        PW.apply_fails_on_rank1,
        2,
        tmp_path=tmp_path,
        args=(str(ckpt), str(tmp_path / "run")),
        deadline=120,
        pg_timeout=60,
    )
    for how in ("broadcast", "folder"):
        mine, theirs = results[1][how], results[0][how]
        assert mine["error"] == theirs["error"] == "RestoreError", (how, mine, theirs)
        assert mine["part"] == theirs["part"] == "optimizer"
        assert "injected on rank 1" in mine["message"] and mine["from"] is None
        assert theirs["from"] == 1 and "rank(s) [1] could not apply the checkpoint" in theirs["message"], theirs
        for rank, res in enumerate(results):
            assert res[how]["unchanged"] == [True] * 4, (how, rank, res[how])
