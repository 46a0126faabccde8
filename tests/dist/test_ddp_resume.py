"""Single-process checkpoints into DDP and back, across real processes with real gloo collectives."""

from __future__ import annotations

import json
import os

import pytest
import torch

import dist_resume
from tests.dist import ddp_workers as W
from tests.dist.harness import run_ranks, run_torchrun, run_two_nodes
from tests.helpers import save_with_device_tag

pytestmark = pytest.mark.dist

WORKER = os.path.join(os.path.dirname(__file__), "torchrun_worker.py")


def _assert_same_state(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for key in expected:
        assert actual[key].dtype == expected[key].dtype, key
        assert torch.equal(actual[key], expected[key]), key


def _single_process_checkpoint(path: str, *, device_tag: str | None = None) -> dict[str, torch.Tensor]:
    model, opt, sched = W.make(seed=0)
    W.train(model, opt, sched, steps=3, seed=7)
    if device_tag is None:
        dist_resume.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3, epoch=1)
    else:  # the same file as if it had been written from a GPU
        dist_resume.save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=3, epoch=1)
        save_with_device_tag(torch.load(path, weights_only=True), path, tag=device_tag)
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


def _results(proc) -> list[dict]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _env(repo_root) -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(repo_root), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


@pytest.mark.timeout(280)
def test_torchrun_resumes_gpu_tagged_single_checkpoint(tmp_path, repo_root):
    ckpt = str(tmp_path / "from_gpu.pt")
    _single_process_checkpoint(ckpt, device_tag="cuda:3")
    proc = run_torchrun([WORKER, ckpt], nproc=2, cwd=tmp_path, env=_env(repo_root), timeout=240)
    reports = _results(proc)
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for r in reports:
        assert r["would_use"] == f"cuda:{r['local_rank']}" == r["would_map"]
        assert r["loaded_devices"] == ["cpu"], "a cuda:3-tagged file must land on this rank's device"
        assert r["restored"][:3] == ["model", "optimizer", "scheduler"] and r["step"] == 3
        assert r["checksums_equal"] and r["losses_finite"]


@pytest.mark.timeout(320)
def test_two_nodes_place_by_local_rank_not_rank(tmp_path, repo_root):
    ckpt = str(tmp_path / "from_gpu.pt")
    _single_process_checkpoint(ckpt, device_tag="cuda:0")
    node0, node1 = run_two_nodes([WORKER, ckpt], nproc_per_node=2, cwd=tmp_path, env=_env(repo_root), timeout=280)
    reports = _results(node0) + _results(node1)
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3]
    by_rank = {r["rank"]: r for r in reports}
    for rank, r in by_rank.items():
        assert r["env"]["RANK"] == str(rank)
        assert r["local_rank"] == rank % 2 and r["node_rank"] == rank // 2
        # global ranks 2 and 3 take cuda:0 and cuda:1 on their node, never cuda:2/cuda:3
        assert r["would_use"] == f"cuda:{rank % 2}" == r["would_map"]
        assert r["loaded_devices"] == ["cpu"]
        assert r["checksums_equal"] and r["losses_finite"]
    assert len({r["checksum"] for r in reports}) == 1
