"""CheckpointManager.resume on 2 real gloo ranks: every rank takes rank 0's branch, or every rank raises.

Timeouts nest: process-group timeout < harness deadline < pytest timeout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import dist_resume as dr
from dist_resume._source.listing import checkpoint_name
from tests.dist import manager_workers as W
from tests.dist.consensus_workers import filled
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _save(path: Path, value: float, step: int) -> None:
    model = filled(value)
    dr.save_checkpoint(path, model=model, optimizer=W.optimizer(model), step=step)


def _prepare(root: Path) -> None:
    _save(root / "init.pt", 7.0, 70)
    split = root / "split"
    for rank in (0, 1):
        (split / f"rank{rank}").mkdir(parents=True)
        _save(split / f"rank{rank}" / "init.pt", 8.0, 80)
    # rank 0 sees a checkpoint, rank 1 an empty folder / no folder at all
    (split / "rank0" / "rank1_empty").mkdir()
    _save(split / "rank0" / "rank1_empty" / checkpoint_name(5), 5.0, 5)
    (split / "rank1" / "rank1_empty").mkdir()
    (split / "rank0" / "rank1_no_folder").mkdir()
    _save(split / "rank0" / "rank1_no_folder" / checkpoint_name(5), 5.0, 5)
    # rank 0 sees none, rank 1 sees one: rank 0 decides, so both use init_from
    (split / "rank0" / "rank0_empty").mkdir()
    (split / "rank1" / "rank0_empty").mkdir()
    _save(split / "rank1" / "rank0_empty" / checkpoint_name(5), 5.0, 5)
    # both folders empty; only rank 0 has the init_from file
    (split / "rank0" / "init_rank1_missing").mkdir()
    (split / "rank1" / "init_rank1_missing").mkdir()
    _save(split / "rank0" / "init_rank1_missing" / "init.pt", 9.0, 90)


def _both(results: list[dict[str, Any]], scenario: str) -> Any:
    first, second = (r[scenario] for r in results)
    assert first[:2] == second[:2] if first[0] == "error" else first == second, f"{scenario}: {first} vs {second}"
    return first


@pytest.mark.timeout(120)
def test_every_rank_takes_rank0s_branch_or_every_rank_raises(tmp_path: Path) -> None:
    _prepare(tmp_path)
    results: list[dict[str, Any]] = run_ranks(W.scenarios, 2, tmp_path=tmp_path, args=(str(tmp_path),))
    assert _both(results, "first_run") == ("ok", (None, -1.0))
    assert _both(results, "init_from") == ("ok", (0, 7.0))
    assert _both(results, "init_from_broadcast") == ("ok", (0, 7.0))
    assert _both(results, "after_save") == ("ok", (12, 12.0))  # init_from is ignored once the run has a checkpoint
    for scenario in ("rank1_empty", "rank1_no_folder"):
        status, cls, msg, ranks = _both(results, scenario)
        assert (status, cls, ranks) == ("error", "CheckpointConsensusError", [1]), (scenario, msg)
    assert _both(results, "rank0_empty") == ("ok", (0, 8.0))  # rank 0's listing decides: init_from on both
    status, cls, msg, ranks = _both(results, "init_rank1_missing")
    assert (status, cls, ranks) == ("error", "CheckpointConsensusError", [1]), msg
    assert "init_from" in msg
