"""A rank's failure reaches every rank as the same exception class, with its attributes and its rank.

Real gloo processes through tests/dist/harness.py; timeouts nest: pg_timeout < deadline < pytest's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._source.listing import checkpoint_name
from tests.dist import typed_workers as W
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist


def _prepare(root: Path) -> None:
    dr.save_checkpoint(root / "model.pt", model=W.small_model())
    for rank, value in ((0, 5.0), (1, 6.0)):  # same name and step, other contents on rank 1
        model = torch.nn.Linear(2, 2)
        torch.nn.init.constant_(model.weight, value)
        (root / "different" / f"rank{rank}").mkdir(parents=True)
        dr.save_checkpoint(root / "different" / f"rank{rank}" / checkpoint_name(5), model=model, step=5)


@pytest.mark.timeout(120)
def test_failures_reach_every_rank_typed(tmp_path: Path) -> None:
    _prepare(tmp_path)
    r0, r1 = run_ranks(W.typed_outcomes, 2, tmp_path=tmp_path, args=(str(tmp_path),), pg_timeout=30, deadline=90)

    # rank 1's KeyMismatchError reaches rank 0 with .missing intact and rank 1 named; nothing changed anywhere
    assert r1["keys"]["cls"] == r0["keys"]["cls"] == "KeyMismatchError"
    assert sorted(r1["keys"]["attrs"]["missing"]) == ["2.bias", "2.weight"], r1["keys"]
    assert r0["keys"]["attrs"]["missing"] == r1["keys"]["attrs"]["missing"]
    assert r0["keys"]["attrs"]["unexpected"] == r1["keys"]["attrs"]["unexpected"] == []
    assert (r0["keys"]["rank"], r1["keys"]["rank"]) == (1, None)  # rank 1 raised its own error
    assert "rank(s) [1]" in r0["keys"]["message"] and "nothing was restored on any rank" in r0["keys"]["message"]
    assert "2.weight" in r0["keys"]["message"]  # rank 1's own wording follows
    assert r0["unchanged"] and r1["unchanged"]

    # rank 1 sees another file: BOTH ranks raise CheckpointConsensusError with .ranks == [1]
    for rank, res in enumerate((r0, r1)):
        assert res["consensus"]["cls"] == "CheckpointConsensusError", (rank, res)
        assert res["consensus"]["attrs"]["ranks"] == [1], (rank, res["consensus"])
        assert "rank 1 sees" in res["consensus"]["message"]

    # an error that does not pickle (it holds a lambda) arrives as class + message + attributes
    got = r1["unpicklable"]
    assert got["cls"] == "UsageError" and got["rank"] == 0
    assert got["message"] == "rank 0 cannot convert this checkpoint (reported by rank 0)"
    assert got["attrs"]["hint"] == "pass another destination" and got["attrs"]["callback"].startswith("<function")
    assert r0["unpicklable"]["rank"] is None and r0["unpicklable"]["attrs"]["hint"] == "pass another destination"
