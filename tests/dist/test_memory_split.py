"""A snapshot's copy split across the node's local ranks (dist_resume/_manager/snapshots/split.py), and its copy into the
folder striped across them (dist_resume/_manager/snapshots/striped_copy.py): 2 gloo ranks of one node, one launch;
``DIST_RESUME_SHM_DIR`` points the snapshots into the test's folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from dist_resume._manager.snapshots.striped_copy import byte_ranges
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
    assert results[0]["copied_small_state"] == total and results[1]["copied_small_state"] == 0  # under the threshold
    # rank 1's copy failed: the same typed error on both ranks, snapshot 3 still the newest
    errors = [res["error"] for res in results]
    assert errors[0] == errors[1] and errors[0][0] == "CheckpointWriteError", errors
    assert "rank(s) [1]" in errors[0][1] and "injected in rank 1's copy" in errors[0][1]
    assert [res["newest_after_failure"] for res in results] == [3, 3]
    # a fresh model resumes from the split snapshot, bitwise
    assert [res["resumed"] for res in results] == [(3, "memory"), (3, "memory")]
    assert all(res["bitwise"] for res in results)
    assert list(shm.iterdir()) == []  # the clean close freed the node's memory

    # save(1) after snapshot(1): each rank wrote at least a third of the file into the folder, the slot's very bytes
    size = results[0]["persist_size"]
    ranges = byte_ranges(size, 2)  # what each wrote: contiguous, in order, cut on 1 MiB, the nearest to halves
    assert ranges[0] == (0, ranges[1][0]) and ranges[1][1] == size and ranges[0][1] % (1 << 20) == 0
    assert abs(ranges[0][1] - size / 2) <= 1 << 19
    assert byte_ranges(10 << 20, 3) == ((0, 3 << 20), (3 << 20, 7 << 20), (7 << 20, 10 << 20))
    for res in results:
        assert res["persisted_striped"] >= size / 3 and res["closed_striped"] >= size / 3, (res, size)
    assert results[0]["persist_identical"] and results[0]["close_identical"]
    # DIST_RESUME_SAVE_RANK0=1: rank 0 wrote all of it
    assert results[0]["persisted_rank0"] >= size and results[1]["persisted_rank0"] < size / 100
    # rank 1's share of the copy of step 3 failed: nothing committed, no temporary file, the previous checkpoint
    # intact, the same error on both ranks at the next call
    assert results[0]["after_copy_failure"] == [
        ".dist_resume.id",
        ".dist_resume.lock",
        "ckpt_00000001.pt",
        "ckpt_00000002.pt",
    ]
    assert results[0]["checkpoint_2"] == 2
    copy_errors = [res["copy_error"] for res in results]
    assert [kind for kind, _ in copy_errors] == ["CheckpointWriteError"] * 2, copy_errors
    for _, message in copy_errors:
        assert "rank(s) [1]" in message and "disk is full" in message and "ckpt_00000003.pt" in message, message
    run = results[0]["lines"]
    lines = {step: [line for line in run if f"run/ckpt_0000000{step}.pt (step {step}," in line] for step in (1, 2, 5)}
    assert all(len(found) == 1 for found in lines.values()), run
    assert "striped over 2 ranks" in lines[1][0] and "striped over 2 ranks" in lines[5][0]
    assert "striped" not in lines[2][0]
    # a small snapshot damaged in memory before its striped copy: nothing committed, the same error on both ranks
    damaged = [res["damaged_error"] for res in results]
    assert [kind for kind, _ in damaged] == ["CheckpointWriteError"] * 2, damaged
    assert all("damaged or overwritten while it was copied" in message for _, message in damaged), damaged
    assert results[0]["after_damage"] == [".dist_resume.id", ".dist_resume.lock"]
    # then rank 1 cannot see that folder: rank 0 copies alone, and says so once
    assert results[0]["unseen_copied"] == [".dist_resume.id", ".dist_resume.lock", "ckpt_00000002.pt"]
    alone = [line for line in run if "from rank 0 alone" in line]
    assert len(alone) == 1 and "small" in alone[0], run
    small = [line for line in run if "small/ckpt_00000002.pt (step 2," in line]
    assert len(small) == 1 and "striped" not in small[0], run
