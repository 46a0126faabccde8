"""A fault on one rank ends the resume with one typed outcome on every rank, within seconds (2 gloo ranks, one launch).

Before the commit (a load, a broadcast of the small states): every rank puts back what it changed and raises the same
class, naming rank 1. In the commit (the copy into the live tensors, unpacking the tensors' broadcast): every rank
raises :class:`PartialRestoreError`, which says that resuming again restores the checkpoint whole, and it does.
"""

from __future__ import annotations

import pytest

from tests.dist import fault_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

PG_TIMEOUT = 60.0
PROMPT = 10.0  # seconds: far below the process-group timeout, which no rank may wait out


def _same_everywhere(results: list[dict], case: str, error: str, part: str | None) -> list[dict]:
    outs = [r[case] for r in results]
    for rank, out in enumerate(outs):
        assert out["error"] == error, (case, rank, out)
        assert out["elapsed"] < PROMPT, (case, rank, out["elapsed"])
        if part is not None:
            assert out["part"] == part, (case, rank, out)
    assert outs[1]["rank"] is None and outs[0]["rank"] == 1, (case, outs)  # raised on 1, relayed to 0
    assert "rank(s) [1]" in outs[0]["message"] and "injected" in outs[0]["message"], (case, outs[0]["message"])
    return outs


@pytest.mark.timeout(200)
def test_a_fault_on_one_rank_is_one_typed_outcome_on_every_rank(tmp_path):
    results = run_ranks(
        W.faults_on_rank1, 2, tmp_path=tmp_path, args=(str(tmp_path),), deadline=180, pg_timeout=PG_TIMEOUT
    )
    # before the commit: nothing changed on any rank
    for case, error, part in (
        ("ddp_folder_optimizer", "RestoreError", "optimizer"),
        ("ddp_file_optimizer", "RestoreError", "optimizer"),
        ("ddp_broadcast_early", "CheckpointError", None),
        ("fsdp_file_optimizer", "RestoreError", "optimizer"),
        ("fsdp_file_scheduler", "RestoreError", "scheduler"),
        ("fsdp_folder_scheduler", "RestoreError", "scheduler"),
    ):
        outs = _same_everywhere(results, case, error, part)
        assert all(out["unchanged"] for out in outs), (case, outs)
        assert "as it was before" in outs[1]["message"] or "nothing was restored" in outs[1]["message"], outs[1]
        assert ".distcp" not in outs[0]["message"], outs[0]  # an intact folder is never blamed
    # ranks that pass different kinds of source (a folder, a file) are refused on every rank, nothing changed
    mixed = [r["ddp_mixed_kinds"] for r in results]
    assert [(m["error"], m["unchanged"]) for m in mixed] == [("CheckpointConsensusError", True)] * 2, mixed
    assert all("rank 1: a checkpoint file" in m["message"] and m["elapsed"] < PROMPT for m in mixed), mixed
    assert [r["ddp_file_copies"]["error"] for r in results] == [None, None]  # node-local copies of one file
    # in the commit: every rank says the state is partly restored, and that resuming again restores it
    for case in ("ddp_folder_commit", "ddp_broadcast_commit", "fsdp_file_commit"):
        outs = _same_everywhere(results, case, "PartialRestoreError", None)
        assert all("resume from it again" in out["message"] for out in outs), (case, outs)
    assert results[0]["ddp_resumed"] == results[1]["ddp_resumed"]  # ... and it did, the same on both ranks
    for rank, r in enumerate(results):  # a load hook FSDP2's fill would skip is refused before anything changes
        assert r["fsdp_hook"]["error"] == "UsageError" and r["fsdp_hook"]["unchanged"] == [], (rank, r["fsdp_hook"])
        assert "load_state_dict hooks" in r["fsdp_hook"]["message"]
