"""dist_resume.testing: the example in its docstring runs, and the launcher's guard rails hold."""

from __future__ import annotations

import importlib
import re
import sys
import time
from pathlib import Path

import pytest

import dist_resume.testing as testing


def _docstring_example() -> str:
    doc = testing.__doc__ or ""
    block = doc.split("::\n", 1)[1].split('"""', 1)[0]
    lines = [line[4:] if line.startswith("    ") else line for line in block.splitlines()]
    return "\n".join(lines).strip() + "\n"


@pytest.mark.dist
def test_module_docstring_example_runs(tmp_path, monkeypatch):
    code = _docstring_example()
    assert "run_ranks(add_ranks, 2" in code and re.search(r"def test_all_reduce", code)
    (tmp_path / "example_run_ranks.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))  # the ranks import the module from the parent's sys.path
    module = importlib.import_module("example_run_ranks")
    try:
        module.test_all_reduce()  # asserts [3.0, 3.0] from two real gloo ranks
    finally:
        sys.modules.pop("example_run_ranks", None)


def _rank_id(rank: int, world_size: int) -> tuple[int, int]:
    return rank, world_size


@pytest.mark.dist
def test_without_a_process_group_on_spawn_with_pids_reported(tmp_path):
    seen: dict[int, int] = {}
    got = testing.run_ranks(
        _rank_id, 2, backend=None, start_method="spawn", timeout=60, on_start=seen.__setitem__, tmp_dir=tmp_path
    )
    assert got == [(0, 2), (1, 2)] and sorted(seen) == [0, 1] and all(pid > 0 for pid in seen.values())


def _finalizer_writes_late(rank: int, world_size: int, folder: str) -> int:
    from multiprocessing import util

    def write() -> None:
        time.sleep(0.5)  # e.g. a coverage tool writing the rank's data file
        Path(folder, f"rank{rank}.exited").write_text("done")

    util.Finalize(None, write, exitpriority=0)
    return rank


@pytest.mark.dist
def test_a_rank_that_reported_runs_its_exit_before_the_launcher_returns(tmp_path):
    assert testing.run_ranks(_finalizer_writes_late, 2, args=(str(tmp_path),), timeout=60) == [0, 1]
    assert sorted(p.name for p in tmp_path.glob("*.exited")) == ["rank0.exited", "rank1.exited"]


def test_rejects_inconsistent_timeouts_local_functions_and_a_missing_tmp_dir(tmp_path):
    with pytest.raises(ValueError, match="is not an existing folder"):  # before any rank starts and waits
        testing.run_ranks(_rank_id, 2, tmp_dir=tmp_path / "missing")
    with pytest.raises(ValueError, match="pg_timeout < deadline"):
        testing.run_ranks(_rank_id, 2, timeout=10, pg_timeout=10)
    with pytest.raises(ValueError, match="multiple of nproc_per_node"):
        testing.run_ranks(_rank_id, 3, nproc_per_node=2)

    def local(rank: int, world_size: int) -> int:
        return rank

    with pytest.raises(ValueError, match="module-level"):
        testing.run_ranks(local, 2)


def test_rank_failure_pickles_with_its_reports():
    import pickle

    err = testing.RankFailure({1: "Traceback ... boom"}, {0: 10, 1: 11}, 2)
    back = pickle.loads(pickle.dumps(err))
    assert back.failures == {1: "Traceback ... boom"} and back.pids == {0: 10, 1: 11} and str(back) == str(err)
