"""Single-process checkpoints into DDP and back, across real processes with real gloo collectives (CPU ranks).

The same under torchrun, one node and two, with every rank on its own accelerator device: test_ddp_accelerator.py.
"""

from __future__ import annotations

import pytest
import torch

import dist_resume
from tests.dist import ddp_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key], expected[key]), key


def _single_process_checkpoint(path: str) -> dict[str, torch.Tensor]:
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=3, seed=7)
    dist_resume.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3, epoch=1)
    return W.flat_state(model, opt)


def test_single_process_checkpoint_resumes_into_two_rank_ddp(tmp_path):
    ckpt = str(tmp_path / "single.pt")
    expected = _single_process_checkpoint(ckpt)
    results = run_ranks(W.single_to_ddp, 2, tmp_path=tmp_path, args=(ckpt,))
    for rank, res in enumerate(results):
        _assert_same_state(res["state"], expected)
        assert res["lr"] == pytest.approx(1e-2 * 0.5), f"rank {rank}: scheduler/optimizer lr not restored"
        assert res["step"] == 3
        assert res["restored"][:3] == ("model", "optimizer", "scheduler")
        assert res["params_equal_across_ranks"], f"rank {rank}: DDP replicas diverged after resume + train"
    assert results[0]["losses"] != results[1]["losses"]  # different data per rank, same weights


def test_ddp_checkpoint_resumes_into_single_process(tmp_path):
    ckpt = str(tmp_path / "ddp.pt")
    results = run_ranks(W.ddp_train_and_save, 2, tmp_path=tmp_path, args=(ckpt,))
    assert all(r["exists"] for r in results), "a rank returned from save_checkpoint before the file existed"
    raw = torch.load(ckpt, weights_only=True)
    assert not any(k.startswith("module.") for k in raw["model"])
    assert raw["meta"]["world_size"] == 2
    model, opt, sched = W.make(seed=123)
    result = dist_resume.resume(ckpt, model=model, optimizer=opt, scheduler=sched)
    _assert_same_state(W.flat_state(model, opt), results[0]["state"])  # rank 0 wrote the file
    assert opt.param_groups[0]["lr"] == results[0]["lr"]
    assert (result.step, result.epoch) == (3, 0)
