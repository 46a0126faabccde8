"""A DDP resume from memory when rank 0 runs on a node whose memory lacks the newest snapshot (a machine replaced, the
ranks numbered anew) and another node holds it: the snapshot is brought to rank 0's node over the process group
(dist_resume/_manager/snapshots/fetch.py), checked, and the resume takes it (two ranks as two nodes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import memory_node_workers as MW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_a_snapshot_only_another_node_holds_reaches_rank_0s_node_and_resumes(tmp_path: Path) -> None:
    results = run_ranks(MW.wiped_rank0_node, 2, tmp_path=tmp_path, args=(str(tmp_path), False), nproc_per_node=1)
    for result in results:
        assert result["resumed"] == (3, "memory") and result["restored"], result
    assert results[0]["fetched"] == ["state.a.json"], results  # rank 0's node got its copy of step 3
    assert results[0]["folder"] == ["ckpt_00000001.pt", "ckpt_00000003.pt"], results  # close() copied it in


def test_a_snapshot_damaged_on_the_way_is_not_kept_and_the_folder_resumes(tmp_path: Path) -> None:
    results = run_ranks(MW.wiped_rank0_node, 2, tmp_path=tmp_path, args=(str(tmp_path), True), nproc_per_node=1)
    for result in results:
        assert result["resumed"] == (1, "folder"), result
    assert results[0]["fetched"] == [], results  # nothing of it committed on rank 0's node
