"""The saved DDP bucket layout (``meta["ddp_buckets"]``) read from a checkpoint: parsed at the boundary, refused whole
when damaged. The replay itself runs on 4 real ranks: tests/dist/test_ddp_buckets.py."""

from __future__ import annotations

import pytest
import torch

import dist_resume
from dist_resume._dist.ddp_buckets import replay_layout, saved_layout
from dist_resume._layout.meta import bucket_layout, meta_problem, toolkit_meta
from dist_resume.errors import CheckpointError, NotACheckpointError


def test_a_layout_is_each_parameter_index_once_bucket_by_bucket():
    assert bucket_layout({"ddp_buckets": [[3, 2], [1, 0]]}) == ((3, 2), (1, 0))
    assert bucket_layout({}) is None and meta_problem("ddp_buckets", None) is None


@pytest.mark.parametrize(
    "value",
    [
        [],
        [[]],
        [[0], []],
        [[0, 1], [1]],  # an index twice
        [[0, 2]],  # an index missing
        [[0, True]],  # a bool is no index
        [[0, 1.0]],
        [[-1, 0]],
        [[0, 10**30]],  # past int64: named, never converted
        [(0, 1)],
        ((0, 1),),
        "0 1",
        {"0": [0]},
        [[torch.tensor(0)]],
    ],
)
def test_a_damaged_layout_is_refused_by_the_boundary(value):
    assert meta_problem("ddp_buckets", value) is not None
    with pytest.raises(NotACheckpointError, match="ddp_buckets"):
        toolkit_meta({"format": "dist_resume", "meta": {"ddp_buckets": value}}, "checkpoint 'x.pt'")


def test_a_checkpoint_with_a_damaged_layout_is_refused_before_anything_changes(tmp_path):
    model = torch.nn.Linear(2, 2)
    path = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, step=1)
    obj = torch.load(path, weights_only=True)
    obj["meta"]["ddp_buckets"] = [[0, 0]]
    torch.save(obj, path)
    live = torch.nn.Linear(2, 2)
    before = [p.clone() for p in live.parameters()]
    with pytest.raises(CheckpointError, match="ddp_buckets"):
        dist_resume.resume(path, model=live)
    assert all(torch.equal(a, b) for a, b in zip(before, live.parameters()))


def test_a_model_without_ddp_records_and_replays_nothing(tmp_path):
    model = torch.nn.Linear(2, 2)
    assert saved_layout(model) is None
    assert replay_layout(model, ((1, 0),)) is False  # local: no process group needed
    path = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, step=1)
    assert "ddp_buckets" not in torch.load(path, weights_only=True)["meta"]
