"""A damaged sharded checkpoint under FSDP2, on 2 ranks: every rank falls back to the older valid checkpoint with its
exact values (CheckpointManager.resume), or, resumed by path, every rank refuses it with the same
CheckpointCorruptError before anything changes (docs/fsdp2.md). One launch for both."""

from __future__ import annotations

import pytest

from tests.dist import hostile_workers as HW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def test_a_damaged_sharded_folder_falls_back_or_is_refused_on_every_rank(tmp_path):
    (tmp_path / "run").mkdir()
    results = run_ranks(HW.fallback_and_refusal, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"),), deadline=150)
    for rank, report in enumerate(results):
        assert report["fallback"] == dict.fromkeys([*HW.FALLBACK, *HW.FOUND_WHEN_READ], (10, [])), (rank, report)
    for name, where, failing in (("flipped_byte", "__0_0.distcp", 1), ("uncovered_rows", ".metadata", None)):
        outcomes = [r["refused"][name] for r in results]
        for rank, o in enumerate(outcomes):
            assert o["error"] == "CheckpointCorruptError" and o["unchanged"] == [], (name, rank, o)
            assert where in o["message"], (name, rank, o["message"])
            if failing is not None:  # the rank whose share of the CRC check found it; the other is told
                assert o["rank"] == (None if rank == failing else failing), (name, rank, o)
