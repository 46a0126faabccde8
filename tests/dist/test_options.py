"""resume's per-part options on the collective path: broadcast_from_rank0 with allow_missing and an EMA (2-rank gloo)."""

from __future__ import annotations

import pytest
import torch
from torch.optim.swa_utils import AveragedModel

import dist_resume
from tests.dist import ddp_workers as W
from tests.dist import options_workers as OW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_broadcast_resume_with_allow_missing_and_ema(tmp_path):
    ckpt = tmp_path / "c.pt"
    model, opt, sched = W.make(seed=0)
    ema = AveragedModel(model)
    for step in range(3):
        W.train(model, opt, sched, steps=1, seed=step)
        ema.update_parameters(model)
    dist_resume.save_checkpoint(ckpt, model=model, optimizer=opt, ema=ema, step=3)  # no scheduler saved
    expected = W.flat_state(model, opt)
    n_keys, n_params = len(model.state_dict()), len(list(model.parameters()))
    results = run_ranks(
        OW.broadcast_with_ema_and_allowed_missing, 2, tmp_path=tmp_path, args=(str(ckpt),), deadline=120, pg_timeout=60
    )
    for rank, res in enumerate(results):
        assert res["restored"] == ("model", "ema", "optimizer", "rng"), rank  # rank 1 derives its streams
        assert res["skipped"] == ("scheduler",) and res["scheduler_unchanged"], rank
        assert res["applied"] == {
            "model": (n_keys, n_keys),
            "optimizer": (n_params, n_params),
            "ema": (n_keys + 1, n_keys + 1),
        }, rank
        assert res["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(res["state"][key], value), (rank, key)
        assert res["n_averaged"] == 3, rank
        for key, value in ema.module.state_dict().items():
            assert torch.equal(res["ema"][key], value), (rank, key)
