"""A DDP run resumed at 4 ranks is bitwise the uninterrupted run: its first step reduces in the saved bucket layout.

DDP reduces the first iteration after its construction in one bucket and then rebuilds its buckets (FACTS 42); past
2 ranks the sums of a resumed run's first step then differ in their last bits, and BatchNorm and momentum carry the
difference on. One launch of 4 gloo ranks runs every variant; each case was checked to differ (7–10 of 23 tensors)
with the layout's replay switched off.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import ddp_bucket_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

CASES = [
    ({}, 1, False),  # saved after one step: DDP rebuilds its buckets at the save, as its next forward would
    ({}, 4, False),
    ({"bucket_cap_mb": 0.01}, 2, False),  # several buckets: rebuilt at the second forward, logged on demand
    ({"bucket_cap_mb": 0.01, "gradient_as_bucket_view": True}, 3, False),
    ({"bucket_cap_mb": 0.01, "static_graph": True}, 3, False),
    ({"bucket_cap_mb": 0.01, "find_unused_parameters": True}, 3, False),  # never rebuilt: nothing to replay
    ({"bucket_cap_mb": 0.01, "hook": True}, 3, False),  # the user's comm hook is carried to the new reducer
    ({"bucket_cap_mb_list": [0.005, 0.01, 0.02]}, 3, False),
    ({"bucket_cap_mb": 0.01}, 3, True),  # a forward before the resume: said at WARNING, not replayed
]


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    folder = tmp_path_factory.mktemp("buckets")
    return run_ranks(W.resumed_against_uninterrupted, 4, tmp_path=folder, args=(str(folder), CASES), deadline=200)


@pytest.mark.parametrize("case", range(len(CASES) - 1), ids=[str(c[:2]) for c in CASES[:-1]])
def test_resumed_ddp_is_bitwise_the_uninterrupted_run_at_4_ranks(results, case):
    for rank, per_rank in enumerate(results):
        row = per_rank[case]
        assert row["differ"] == 0, f"rank {rank}: {row['differ']} tensors differ 4 steps after the resume"
        assert row["warned"] == [], row["warned"]
        assert row["carried"] == row["layout"]  # a save before the resumed run's first step records the same layout


def test_the_layout_is_recorded_once_rebuilt_and_never_for_find_unused_parameters(results):
    rows = results[0]
    assert rows[0]["layout"] is not None and sorted(i for bucket in rows[0]["layout"] for i in bucket) == list(
        range(10)
    )
    assert len(rows[2]["layout"]) > 1  # bucket_cap_mb=0.01: several buckets
    assert rows[5]["layout"] is None  # find_unused_parameters: the initial buckets are kept, nothing to replay


@pytest.mark.cuda
@pytest.mark.multigpu
def test_on_gpus_with_nccl_the_resume_is_bitwise_too(tmp_path):
    """The multi-GPU job: every GPU a rank, NCCL (its ring and tree algorithms follow the bucket too)."""
    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if world < 2:
        pytest.skip("needs at least two CUDA GPUs")
    cases = [case for case in CASES if not case[2]]
    results = run_ranks(
        W.resumed_against_uninterrupted, world, tmp_path=tmp_path, args=(str(tmp_path), cases), backend="nccl",
        deadline=300,
    )  # fmt: skip
    for rank, per_rank in enumerate(results):
        assert [row["differ"] for row in per_rank] == [0] * len(cases), f"rank {rank}"


def test_a_ddp_that_ran_before_the_resume_is_named_at_warning(results):
    assert any("ran a forward pass before the resume" in m for m in results[0][-1]["warned"])
    assert "ran a forward pass before the resume" in results[0][-1]["not_replayed"]  # saved: the check's evidence
    assert all(per_rank[case]["not_replayed"] is None for per_rank in results for case in range(len(CASES) - 1))
    assert all(per_rank[-1]["warned"] == [] for per_rank in results[1:])  # rank 0 says it
