"""torchdata's StatefulDataLoader saved and restored per rank (dist_resume/_exact/stateful_loader.py), and the plain
DataLoader whose workers prefetch, detected and warned about once."""

from __future__ import annotations

import collections
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from dist_resume import ResumableDistributedSampler
from dist_resume._exact import loaders
from dist_resume._exact import stateful_loader as sl
from dist_resume.errors import StateMismatchError

pytest.importorskip("torchdata.stateful_dataloader")
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.helpers import dataset_of
from tests.stateful_loader_worker import BATCH, KINDS, SEED, TRAINED, N

REPO_ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, timeout: float = 120) -> None:
    """``python -m tests.stateful_loader_worker ARGS`` in a new process (and session: its DataLoader workers go with
    it on a timeout)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.stateful_loader_worker", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"the worker overran {timeout} s:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]


def _reference(kind: str, world: int, epoch: int) -> list[list[int]]:
    """What each rank's sampler yields in ``epoch`` of an uninterrupted run."""
    out = []
    for rank in range(world):
        sampler = KINDS[kind](list(range(N)), num_replicas=world, rank=rank, seed=SEED)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_a_mid_epoch_save_with_prefetching_workers_resumes_exactly_in_a_new_process(tmp_path: Path) -> None:
    """2 workers, prefetch 4: the saved state counts what the loop trained on, not what the workers drew. Same world
    size: each rank continues exactly (both samplers). World size 2 -> 3: the ResumableDistributedSampler finishes
    the epoch over the new ranks with every sample once; a plain DistributedSampler is refused (its per-rank skip
    count points into another partition), changing nothing."""
    saved, result = tmp_path / "loaders.pt", tmp_path / "result.json"
    _run("save", str(saved))
    _run("restore", str(saved), str(result))
    report: dict[str, Any] = json.loads(result.read_text())
    for kind in KINDS:
        same = report[f"{kind}/2"]
        assert same["modes"] == ["full", "full"]
        expected = _reference(kind, 2, 1)
        for rank in range(2):
            assert same["trained"][rank] == expected[rank][: TRAINED * BATCH]
            assert same["rest"][rank] == expected[rank][TRAINED * BATCH :], f"{kind}: rank {rank} continues exactly"
        assert same["next_epoch"] == _reference(kind, 2, 2), f"{kind}: the next epoch is a fresh, full one"
    grown = report["resumable/3"]
    assert grown["modes"] == ["sampler"] * 3
    seen = collections.Counter(i for part in grown["trained"] + grown["rest"] for i in part)
    assert sorted(seen) == list(range(N)) and set(seen.values()) == {1}, "epoch 1: every sample exactly once"
    assert grown["next_epoch"] == _reference("resumable", 3, 2)
    refused = report["distributed/3"]["refused"]
    assert refused.startswith("StateMismatchError") and "saved by 2 rank(s), 3 now" in refused
    assert "Nothing was restored" in refused


def _loader(num_workers: int = 0, **kw: Any) -> Any:
    data = list(range(24))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=0, seed=0)
    if num_workers:
        kw |= {"num_workers": num_workers, "prefetch_factor": 2}
    return StatefulDataLoader(dataset_of(data), batch_size=2, sampler=sampler, **kw)


def test_a_saved_state_is_validated_before_anything_changes() -> None:
    loader = _loader()
    it = iter(loader)
    next(it)
    entries = sl.merge_loader_states([sl.loader_state(loader)] * 2)
    assert sl.loader_position(entries[0])["consumed"] == 4  # type: ignore[index]
    fresh = _loader()
    for bad, match in [
        ("nonsense", "not a list of per-rank"),
        ([{**entries[0], "kind": "other"}] * 2, "not torchdata.StatefulDataLoader's"),
        ([{**entries[0], "num_samples": 25}] * 2, "had 25 samples when saved, 24 now"),
        ([{**entries[0], "sampler": "RandomSampler"}] * 2, "was RandomSampler when saved"),
        ([{**entries[0], "state": {"_num_yielded": 1}}] * 2, "lacks keys torchdata reads back"),
    ]:
        with pytest.raises(StateMismatchError, match=match):
            sl.check_loader_state(fresh, bad)
    position = {**entries[0]["state"]["_sampler_iter_state"]["sampler_state"], "seed": 9}
    state = {**entries[0]["state"], "_sampler_iter_state": {"sampler_state": position, "samples_yielded": 2}}
    with pytest.raises(StateMismatchError, match="seed 9 saved"):
        sl.check_loader_state(fresh, [{**entries[0], "state": state}] * 2)
    assert fresh.sampler.consumed == 0 and fresh.state_dict()["_num_yielded"] == 0  # nothing changed
    with pytest.raises(StateMismatchError, match="different positions"):
        other = _loader()
        sl.merge_loader_states([sl.loader_state(loader), sl.loader_state(other)])


def test_num_workers_changed_restores_the_sampler_and_a_plain_loader_takes_the_position() -> None:
    loader = _loader(num_workers=2)
    it = iter(loader)
    trained = [next(it).tolist() for _ in range(2)]
    entries = [sl.loader_state(loader)] * 2
    del it
    single = _loader()  # num_workers=0 now
    plan = sl.check_loader_state(single, entries)
    assert plan.mode is sl.RestoreMode.SAMPLER
    sl.restore_loader(plan)
    plain = DataLoader(dataset_of(list(range(24))), batch_size=2, sampler=ResumableDistributedSampler(24, 2, 0, seed=0))
    sl.restore_loader(sl.check_loader_state(plain, entries))  # a plain DataLoader holding the sampler: exact too
    expected = list(ResumableDistributedSampler(24, 2, 0, seed=0))
    assert [i for b in trained for i in b] == expected[:4]
    for restored in (single, plain):
        assert [i for b in restored for i in b.tolist()] == expected[4:]


def test_the_plain_dataloader_with_workers_is_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    data = list(range(40))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=0)
    loader = DataLoader(dataset_of(data), batch_size=2, sampler=sampler, num_workers=2)
    assert sl.is_stateful_loader(_loader()) and not sl.is_stateful_loader(loader)
    text = loaders.prefetch_warning(loader)
    assert text is not None and "2 worker(s) and prefetch_factor=2" in text
    assert loaders.prefetch_warning(DataLoader(dataset_of(data), sampler=sampler)) is None  # num_workers=0: exact
    assert loaders.prefetch_warning(_loader(num_workers=2)) is None  # a StatefulDataLoader: exact
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        loaders.warn_prefetch_once(loader)
        loaders.warn_prefetch_once(loader)
        for _ in loader:  # the sampler sees the workers drawing too: still the one warning
            pass
        sampler.state_dict()
    assert [r.getMessage() for r in caplog.records] == [text]


def test_a_loader_whose_batches_cannot_be_counted_is_warned_and_a_foreign_position_refused() -> None:
    data = list(range(40))
    sampler = ResumableDistributedSampler(data, num_replicas=2, rank=0)
    unordered = DataLoader(dataset_of(data), batch_size=2, sampler=sampler, num_workers=2, persistent_workers=True)
    assert loaders.prefetch_warning(unordered) is None  # persistent and countable: exact
    unordered.in_order = False
    text = loaders.prefetch_warning(unordered)
    assert text is not None and "in_order=False" in text and "cannot be counted" in text
    from torch.utils.data import DistributedSampler

    position = loaders.StatefulLoaderPosition(
        StatefulDataLoader(
            dataset_of(data), batch_size=2, sampler=DistributedSampler(dataset_of(data), num_replicas=2, rank=0)
        )
    )
    with pytest.raises(StateMismatchError, match="no StatefulDataLoader state, and this loader's sampler is a"):
        position.check_state(sampler.state_dict(), "ckpt")
