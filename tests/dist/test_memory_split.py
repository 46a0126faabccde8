"""A snapshot's copy split across the node's local ranks (dist_resume/_manager/memory/split.py): 2 gloo ranks of one
node, one launch; ``DIST_RESUME_SHM_DIR`` points the snapshots into the test's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist import memory_split_workers as W
from tests.dist.harness import run_ranks


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_every_local_rank_copies_its_share_and_a_failed_share_commits_nothing(tmp_path: Path) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    results = run_ranks(
        W.split_checks, 2, tmp_path=tmp_path, args=(str(tmp_path),), env={"DIST_RESUME_SHM_DIR": str(shm)}, deadline=150
    )
    total = results[0]["tensor_bytes"]
    assert total > 20 << 20
    for res in results:  # split: every rank copied at least a third of the tensor bytes
        assert res["copied_split"] >= total / 3 and res["copied_3"] >= total / 3, (res, total)
    assert results[0]["copied_split"] + results[1]["copied_split"] == total
    # the writer alone under the private switch
    assert results[0]["copied_writer_only"] == total and results[1]["copied_writer_only"] == 0
    # rank 1's copy failed: the same typed error on both ranks, snapshot 3 still the newest
    errors = [res["error"] for res in results]
    assert errors[0] == errors[1] and errors[0][0] == "CheckpointWriteError", errors
    assert "rank(s) [1]" in errors[0][1] and "injected in rank 1's copy" in errors[0][1]
    assert [res["newest_after_failure"] for res in results] == [3, 3]
    # a fresh model resumes from the split snapshot, bitwise
    assert [res["resumed"] for res in results] == [(3, "memory"), (3, "memory")]
    assert all(res["bitwise"] for res in results)
    assert list(shm.iterdir()) == []  # the clean close freed the node's memory
