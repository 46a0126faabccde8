"""resume(..., broadcast_from_rank0=True): one reader, bucketed broadcasts, all-or-nothing on every rank."""

from __future__ import annotations

import pytest
import torch

import dist_resume
from tests.dist import broadcast_workers as B
from tests.dist import ddp_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_tensors_of_every_kind_survive_small_buckets(tmp_path):
    results = run_ranks(B.mixed_tree, 2, tmp_path=tmp_path)
    sent, got = results
    assert got["plain"] == {"step": 12, "name": "run"} and got["nested"][1][1:] == ("text", 7)
    for key in ("big", "bf16", "bool", "int", "scalar", "empty", "strided"):
        assert got[key].dtype == sent[key].dtype and got[key].shape == sent[key].shape, key
        assert torch.equal(got[key], sent[key]), key
    assert torch.equal(got["nested"][0]["x"], torch.ones(3))
    assert torch.equal(got["nested"][1][0], torch.zeros(2, dtype=torch.uint8))


def test_only_rank0_reads_and_every_rank_restores(tmp_path):
    folder = tmp_path / "ckpts"
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=3, seed=1)
    manager = dist_resume.CheckpointManager(folder, keep_last=2)
    saved = manager.save(3, model=model, optimizer=opt, scheduler=sched)
    expected = W.flat_state(model, opt)
    results = run_ranks(B.resume_from_rank0, 2, tmp_path=tmp_path, args=(str(folder), str(saved)))
    for rank, res in enumerate(results):
        assert res["path"] == str(saved), f"rank {rank} resumed from {res['path']}"
        assert res["step"] == 3 and res["lr"] == opt.param_groups[0]["lr"]
        assert res["state"].keys() == expected.keys()
        for key, value in expected.items():
            assert torch.equal(res["state"][key], value), (rank, key)


def test_a_rank_that_cannot_validate_stops_every_rank_before_any_change(tmp_path):
    ckpt = tmp_path / "c.pt"
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=1, seed=1)
    dist_resume.save_checkpoint(ckpt, model=model, optimizer=opt)
    results = run_ranks(B.one_rank_cannot_validate, 2, tmp_path=tmp_path, args=(str(ckpt),))
    for rank, res in enumerate(results):
        assert res["error"] is not None, f"rank {rank} restored although rank 1 could not"
        assert res["unchanged"] and res["opt_state"] == 0, f"rank {rank} changed its model or optimizer"
    assert "rank(s) [1]" in results[0]["message"]
    assert results[1]["error"] == "KeyMismatchError"


def test_a_file_without_data_for_a_model_entry_stops_every_rank_before_any_change(tmp_path):
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=1, seed=1)
    obj = torch.load(dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt), weights_only=True)
    key = next(iter(obj["model"]))
    obj["model"][key] = obj["model"][key].to("meta")  # torch.save writes no data for it
    torch.save(obj, tmp_path / "meta.pt")
    results = run_ranks(B.file_without_data, 2, tmp_path=tmp_path, args=(str(tmp_path / "meta.pt"),))
    for rank, res in enumerate(results):
        assert res["error"] == "StateMismatchError", (rank, res)
        assert res["unchanged"] and res["opt_state"] == 0, f"rank {rank} changed its model or optimizer"
    assert key in results[0]["message"] and "meta tensors" in results[0]["message"]


def test_rank0_read_error_reaches_every_rank(tmp_path):
    results = run_ranks(B.rank0_cannot_read, 2, tmp_path=tmp_path, args=(str(tmp_path / "missing.pt"),))
    assert [r["error"] for r in results] == ["CheckpointNotFoundError"] * 2
    assert "missing.pt" in results[1]["message"] and "rank 0" in results[1]["message"]


def test_async_saves_are_collective_and_errors_reach_every_rank(tmp_path):
    folder = tmp_path / "ckpts"
    results = run_ranks(B.async_saves, 2, tmp_path=tmp_path, args=(str(folder),))
    assert sorted(p.name for p in folder.iterdir()) == [".dist_resume.lock", "ckpt_00000002.pt"]  # rank 0 held the lock
    saved = torch.load(folder / "ckpt_00000002.pt", weights_only=True)
    assert torch.equal(saved["model"]["fc.weight"], results[0]["weight"])
    for rank, res in enumerate(results):
        assert res["first_done"] and res["path"].endswith("ckpt_00000002.pt"), rank
        assert res["error"] is not None and "does not exist" in res["error"], f"rank {rank} missed rank 0's error"
