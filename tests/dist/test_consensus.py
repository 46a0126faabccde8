"""Ranks agree on the checkpoint to resume from (real gloo processes through tests/dist/harness.py).

Timeouts nest: process-group timeout < harness deadline < pytest timeout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import dist_resume as dr
from dist_resume._source.listing import checkpoint_name
from tests.dist import consensus_workers as W
from tests.dist.harness import RankFailure, run_ranks

pytestmark = pytest.mark.dist


def _save(folder: Path, step: int, value: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return Path(dr.save_checkpoint(folder / checkpoint_name(step), model=W.filled(value), step=step))


def _prepare(root: Path) -> None:
    """Per-rank folders: rank 0's view in rank0/, rank 1's in rank1/."""
    for scenario in ("different", "missing", "truncated", "stale", "broken"):
        if scenario != "broken":
            _save(root / scenario / "rank0", 5, 5.0)
    _save(root / "different" / "rank1", 5, 6.0)  # same name and step, other contents
    _save(root / "missing" / "rank1", 4, 4.0)  # rank 1 lacks rank 0's choice
    data = (root / "truncated" / "rank0" / checkpoint_name(5)).read_bytes()
    (root / "truncated" / "rank1").mkdir(parents=True)
    (root / "truncated" / "rank1" / checkpoint_name(5)).write_bytes(data[: len(data) // 2])
    (root / "stale" / "rank1").mkdir(parents=True)  # rank 1 sees a newer file too: it follows rank 0
    shutil.copy2(root / "stale" / "rank0" / checkpoint_name(5), root / "stale" / "rank1" / checkpoint_name(5))
    _save(root / "stale" / "rank1", 6, 6.0)
    (root / "empty" / "rank0").mkdir(parents=True)
    _save(root / "empty" / "rank1", 5, 5.0)
    for rank in (0, 1):
        (root / "broken" / f"rank{rank}").mkdir(parents=True)
        (root / "broken" / f"rank{rank}" / checkpoint_name(9)).write_bytes(b"PK\x03\x04 torn")


def _consensus_error(results: list[dict[str, Any]], scenario: str, reason: str) -> None:
    for rank, res in enumerate(results):
        status, cls, msg, ranks = res[scenario]
        assert (status, cls, ranks) == ("error", "CheckpointConsensusError", [1]), f"rank {rank}: {res[scenario]}"
        assert "ranks [1] do not see the checkpoint rank 0 chose, ckpt_00000005.pt (step 5" in msg, msg
        assert reason in msg and "shared filesystem" in msg, msg


@pytest.mark.timeout(120)
def test_ranks_agree_or_all_raise(tmp_path: Path) -> None:
    _prepare(tmp_path)
    results: list[dict[str, Any]] = run_ranks(
        W.agreement, 2, tmp_path=tmp_path, args=(str(tmp_path),), pg_timeout=30, deadline=90
    )
    r0, r1 = results
    shared = tmp_path / "shared"
    # a collective save: rank 0 writes and rotates, both ranks return the same paths
    assert r0["save"] == r1["save"] == ("ok", [str(shared / checkpoint_name(1)), str(shared / checkpoint_name(2))])
    assert r0["listing"] == r1["listing"] == ("ok", [checkpoint_name(2)])
    for res in results:  # rank 0's failure reaches every rank; nothing is written
        assert res["save_fails"][:2] == ("error", "CheckpointWriteError") and "weights_only" in res["save_fails"][2]
    assert sorted(p.name for p in shared.iterdir()) == [".dist_resume.lock", checkpoint_name(2)]  # rank 0 held the lock
    assert r0["shared"] == r1["shared"] == ("ok", str(shared / checkpoint_name(2)))
    assert r0["resume"] == r1["resume"] == ("ok", (2, True))
    for rank, res in enumerate(results):  # node-local copies of the same file: each rank uses its own
        assert res["copies"] == ("ok", str(tmp_path / f"copy{rank}" / checkpoint_name(2)))
        assert res["stale"] == ("ok", str(tmp_path / "stale" / f"rank{rank}" / checkpoint_name(5)))
    _consensus_error(results, "different", "rank 1 sees")
    assert "digest" in r0["different"][2]
    _consensus_error(results, "missing", "rank 1 has no file")
    _consensus_error(results, "truncated", "rank 1 cannot read")
    for res in results:  # rank 0 found nothing: every rank gets its error, even rank 1 whose folder is fine
        assert res["empty"][:2] == ("error", "CheckpointNotFoundError"), res["empty"]
        assert "is empty" in res["empty"][2] and str(tmp_path / "empty" / "rank0") in res["empty"][2]
        assert res["broken"][:2] == ("error", "CheckpointCorruptError"), res["broken"]
    assert "reported by rank 0" in r1["empty"][2] and "reported by rank 0" in r1["broken"][2]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["sleeps", "dies"])
def test_absent_rank_ends_in_an_error_within_the_timeout(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "ckpts"
    _save(folder, 1, 1.0)
    pg_timeout = 2.0
    try:
        run_ranks(
            W.absent_rank, 2, tmp_path=tmp_path, args=(str(folder), how, pg_timeout), pg_timeout=pg_timeout, deadline=40
        )
    except RankFailure as err:
        assert how == "dies" and set(err.failures) == {1}, str(err)  # only the rank that died
    else:
        assert how == "sleeps"
    report = json.loads((tmp_path / "rank0.json").read_text())
    status, cls, msg, _ = report["outcome"]
    assert (status, cls) == ("error", "CheckpointConsensusError"), report
    assert "a rank died, is stuck, or did not call resume()" in msg and str(folder) in msg, msg
    assert report["elapsed"] < pg_timeout + 10, report  # bounded by the process-group timeout, not a hang
