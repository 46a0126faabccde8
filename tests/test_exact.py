"""Exact resume in one process: ResumableDistributedSampler and per-rank RNG state."""

from __future__ import annotations

import collections
import io
import logging
import random
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

import dist_resume
from dist_resume import ResumableDistributedSampler as Sampler
from dist_resume._exact import rank_states as _rank_states
from dist_resume._exact import rng as _rng
from dist_resume.errors import StateMismatchError
from tests.helpers import dataset_of, fake_accelerator

try:  # optional: dist_resume's runtime needs torch only, and CI runs without numpy
    import numpy as np
except ImportError:
    np = None  # type: ignore[assignment]  # numpy is optional


def _ranks(n: int, world: int, **kw: Any) -> list[Sampler]:
    return [Sampler(n, num_replicas=world, rank=r, **kw) for r in range(world)]


def _take(samplers: list[Sampler], rounds: int) -> list[int]:
    """Each rank draws ``rounds`` indices (lockstep, as DDP ranks do); returns them all."""
    its = [iter(s) for s in samplers]
    return [next(it) for _ in range(rounds) for it in its]


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------- sampler: fresh epochs


@pytest.mark.parametrize("n,world", [(10, 1), (10, 2), (11, 3), (7, 4), (3, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_fresh_epoch_matches_distributed_sampler(n, world, shuffle, drop_last):
    if drop_last and n < world:
        pytest.skip("rejected by design, see test_invalid_arguments")
    for rank in range(world):
        ours = Sampler(n, num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last)
        theirs: DistributedSampler[int] = DistributedSampler(
            dataset_of(range(n)), num_replicas=world, rank=rank, shuffle=shuffle, seed=5, drop_last=drop_last
        )
        for epoch in (0, 1):
            theirs.set_epoch(epoch)
            assert ours.epoch == epoch
            assert len(ours) == len(theirs)
            assert list(ours) == list(theirs), (rank, epoch)  # ours advanced by itself


def test_epoch_advances_by_itself_so_forgetting_set_epoch_cannot_repeat_a_shuffle():
    s = Sampler(50, num_replicas=1, rank=0, seed=0)
    first, second = list(s), list(s)
    assert s.epoch == 2 and first != second and sorted(first) == sorted(second) == list(range(50))
    s.set_epoch(2)  # the DistributedSampler idiom: a no-op for the current epoch
    assert s.epoch == 2 and s.consumed == 0


def test_set_epoch_keeps_a_resumed_position_and_warns_when_abandoning_one(caplog):
    s = Sampler(20, num_replicas=2, rank=0, seed=0)
    s.load_state_dict({"epoch": 3, "consumed": 8, "num_samples": 20, "seed": 0, "shuffle": True})
    s.set_epoch(3)  # the usual `for epoch in range(start, E): sampler.set_epoch(epoch)` loop
    assert (s.epoch, s.consumed, len(s)) == (3, 8, 6)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        s.set_epoch(4)
    assert (s.epoch, s.consumed) == (4, 0)
    assert "abandons epoch 3 after 8 of 20 samples" in caplog.text
    with pytest.raises(ValueError, match="non-negative int"):
        s.set_epoch(-1)


# ---------------------------------------------------------------- sampler: resume


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_mid_epoch_with_the_same_world_size_continues_exactly(world):
    n, rounds, stop = 31, 11, 4
    reference = _ranks(n, world, seed=9)
    expected = [[next(it) for _ in range(rounds)] for it in map(iter, reference)]
    first = _ranks(n, world, seed=9)
    its = [iter(s) for s in first]
    before = [[next(it) for _ in range(stop)] for it in its]
    state = _roundtrip(first[0].state_dict())  # saved from rank 0, loads with weights_only=True
    assert state["consumed"] == stop * world and state["epoch"] == 0
    resumed = _ranks(n, world, seed=9)
    for s in resumed:
        s.load_state_dict(state)
    after = [[next(it) for _ in range(rounds - stop)] for it in map(iter, resumed)]
    assert [b + a for b, a in zip(before, after)] == expected


@pytest.mark.parametrize("old,new", [(2, 1), (1, 2), (2, 3), (3, 2), (4, 2), (2, 4)])
def test_world_size_change_mid_epoch_sees_every_sample_once(old, new):
    n, rounds = 48, 6
    samplers = _ranks(n, old, seed=1)
    before = _take(samplers, rounds=rounds)
    state = samplers[0].state_dict()
    assert state["consumed"] == rounds * old
    assert (n - rounds * old) % new == 0  # no final partial round: "every sample once" holds exactly
    assert sorted(before) == sorted(Sampler(n, 1, 0, seed=1)._order(0)[: rounds * old])  # the permutation's prefix
    resumed = _ranks(n, new, seed=1)
    for s in resumed:
        s.load_state_dict(state)
    after = [i for s in resumed for i in s]
    assert sorted(before + after) == list(range(n))
    assert all(s.epoch == 1 for s in resumed)


@pytest.mark.parametrize("drop_last", [False, True])
def test_padding_happens_only_in_the_final_round(drop_last):
    n, old, new = 23, 2, 3
    samplers = _ranks(n, old, seed=2, drop_last=drop_last)
    before = _take(samplers, rounds=4)
    resumed = _ranks(n, new, seed=2, drop_last=drop_last)
    for s in resumed:
        s.load_state_dict(samplers[0].state_dict())
    after = [i for s in resumed for i in s]
    left = n - len(before)  # 15 left for 3 ranks: 5 rounds, nothing padded or dropped
    assert left % new == 0 and sorted(before + after) == list(range(n))
    # 2 -> 3 after 3 rounds: 17 left, 5 full rounds and a final round of 2
    samplers = _ranks(n, old, seed=2, drop_last=drop_last)
    before = _take(samplers, rounds=3)
    resumed = _ranks(n, new, seed=2, drop_last=drop_last)
    for s in resumed:
        s.load_state_dict(samplers[0].state_dict())
    after = [i for s in resumed for i in s]
    counts = collections.Counter(before + after)
    order = Sampler(n, 1, 0, seed=2)._order(0)
    if drop_last:  # the final partial round (2 samples) is dropped
        assert len(counts) == n - 2 and max(counts.values()) == 1
        assert set(range(n)) - set(counts) == set(order[-2:])
    else:  # padded with the permutation's first sample: the only duplicate
        assert set(counts) == set(range(n))
        assert [i for i, c in counts.items() if c > 1] == [order[0]] and counts[order[0]] == 2


def test_checkpoint_at_the_end_of_an_epoch_resumes_into_the_next_one():
    samplers = _ranks(8, 2, seed=0)
    _take(samplers, rounds=4)  # every index yielded, the generators not yet exhausted
    state = samplers[0].state_dict()
    assert (state["epoch"], state["consumed"]) == (1, 0)  # the position of the next sample: epoch 1's first
    following = list(Sampler(8, 2, 0, seed=0, shuffle=True)._order(1))[0::2]
    for saved in (state, {**state, "epoch": 0, "consumed": 8}):  # as 0.3 saved it too
        s = Sampler(8, 2, 0, seed=0)
        s.load_state_dict(saved)
        assert (s.epoch, s.consumed, len(s)) == (1, 0, 4)
        assert list(s) == following, "a peek after the resume finds epoch 1's first batch, as without the stop"
    dropped = _ranks(9, 2, seed=0, drop_last=True)
    _take(dropped, rounds=4)  # 8 of 9: the last sample is dropped, the epoch is over
    assert dropped[1].state_dict()["epoch"] == 1


def test_a_new_iterator_restarts_at_the_resume_position_and_the_old_one_stops():
    s = Sampler(10, 1, 0, shuffle=False)
    old = iter(s)
    assert [next(old), next(old)] == [0, 1] and s.consumed == 2
    assert list(s) == list(range(10)) and s.epoch == 1  # a fresh epoch restarts at 0, as DistributedSampler does
    assert list(old) == []  # superseded: yields nothing, does not advance the epoch again
    assert s.epoch == 1
    s.load_state_dict({"epoch": 3, "consumed": 6, "num_samples": 10, "seed": 0, "shuffle": False})
    peek = iter(s)
    assert next(peek) == 6 and s.consumed == 7
    assert len(s) == 4 and list(s) == [6, 7, 8, 9] and s.epoch == 4  # a resumed epoch restarts where it resumed


def test_the_ddp_tutorials_peek_costs_no_batch():
    """PyTorch's multigpu_torchrun.py reads one batch every epoch to learn the batch size, then iterates."""
    data = list(range(64))
    samplers = _ranks(len(data), 2, seed=0)
    loaders = [DataLoader(dataset_of(data), batch_size=4, sampler=s) for s in samplers]
    for epoch in range(2):
        seen = []
        for loader in loaders:
            batch_size = len(next(iter(loader)))
            sampler = loader.sampler
            assert isinstance(sampler, Sampler)
            sampler.set_epoch(epoch)
            steps = 0
            for batch in loader:
                seen += batch.tolist()
                steps += 1
            assert (batch_size, steps) == (4, 8)  # 8 of 8 steps, not 7
        assert sorted(seen) == data, f"epoch {epoch}: every sample exactly once"


def test_a_multi_worker_dataloader_drawing_from_the_sampler_is_warned_once(caplog):
    data = list(range(40))
    s = Sampler(data, num_replicas=2, rank=0, seed=0)
    loader = DataLoader(dataset_of(data), batch_size=2, sampler=s, num_workers=2, prefetch_factor=2)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        it = iter(loader)
        next(it)
        s.state_dict()  # what a save calls
        s.state_dict()
        assert s.state_dict(consumed=2)["consumed"] == 4  # the way around it: no warning
        del it
        for _ in loader:
            pass
        s.state_dict()
    warned = [r.getMessage() for r in caplog.records if "prefetch" in r.getMessage()]
    assert len(warned) == 1 and "2 worker(s) and prefetch_factor=2" in warned[0] and "StatefulDataLoader" in warned[0]
    quiet = Sampler(data, num_replicas=2, rank=0, seed=0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        for _ in DataLoader(dataset_of(data), batch_size=2, sampler=quiet):  # num_workers=0: exact, nothing to say
            pass
        quiet.state_dict()
    assert not caplog.records


def test_dataloader_with_its_own_generator_positions_and_the_global_rng():
    data = list(range(40))
    s = Sampler(data, num_replicas=2, rank=1, seed=0)
    loader = DataLoader(dataset_of(data), batch_size=4, sampler=s, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    for step, _ in enumerate(loader, 1):
        if step == 3:
            break
    assert s.state_dict()["consumed"] == 3 * 4 * 2  # num_workers=0: exactly what was trained on
    assert torch.equal(torch.rand(1), expected), "a DataLoader with its own generator leaves the global RNG alone"
    assert s.state_dict(consumed=8)["consumed"] == 16
    with pytest.raises(ValueError, match="consumed=13"):
        s.state_dict(consumed=13)


def test_load_state_dict_rejects_another_permutation_and_changes_nothing():
    s = Sampler(20, 2, 0, seed=1)
    it = iter(s)
    next(it)
    good = s.state_dict()
    for key, value, match in [
        ("num_samples", 21, "num_samples 21 saved, 20 now"),
        ("seed", 2, "seed 2 saved"),
        ("shuffle", False, "shuffle False saved"),
        ("consumed", 30, "exceeds"),
        ("epoch", -1, "not a non-negative int"),
        ("consumed", True, "not a non-negative"),
    ]:
        with pytest.raises(StateMismatchError, match=match):
            s.load_state_dict({**good, key: value})
        assert s.state_dict() == good
    with pytest.raises(StateMismatchError, match="not a ResumableDistributedSampler state"):
        s.load_state_dict({"epoch": 0})


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"dataset": 0, "num_replicas": 1, "rank": 0}, ValueError, "empty"),
        ({"dataset": 4, "num_replicas": 2, "rank": 2}, ValueError, "rank=2 must be in 0..num_replicas-1"),
        ({"dataset": 4, "num_replicas": 0, "rank": 0}, ValueError, "num_replicas=0"),
        ({"dataset": 4, "num_replicas": 2, "rank": 0, "seed": 1.5}, TypeError, "seed must be an int"),
        ({"dataset": 4, "num_replicas": 2, "rank": 0, "shuffle": 1}, TypeError, "shuffle must be a bool"),
        ({"dataset": 3, "num_replicas": 4, "rank": 0, "drop_last": True}, ValueError, "leaves every rank empty"),
    ],
)
def test_invalid_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        Sampler(**kwargs)


def test_defaults_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    s = Sampler(range(9))
    assert (s.rank, s.num_replicas, s.num_samples, len(s)) == (1, 3, 9, 3)
    with pytest.raises(AttributeError):
        s._cfg.rank = 0  # type: ignore[misc]  # frozen config: the assignment must raise


# ---------------------------------------------------------------- RNG


def _draw() -> tuple[float, torch.Tensor, float]:
    return random.random(), torch.rand(3), float(np.random.rand()) if np is not None else 0.0


def test_rng_state_round_trips_through_a_weights_only_load():
    dist_resume.seed_rng(3, rank=0)
    state = _roundtrip(dist_resume.rng_state_dict("cpu"))
    assert state["device"] is None and "cuda" not in state and state["seed"] == 3
    assert state["numpy"] is None if np is None else state["numpy"]["keys"].dtype == torch.int64
    expected = _draw()
    _draw()
    dist_resume.load_rng_state_dict(state, "cpu")
    got = _draw()
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]


def test_seed_rng_gives_each_rank_and_step_its_own_stream():
    seeds = {dist_resume.derive_seed(7, r, s) for r in range(4) for s in (0, 100)}
    assert len(seeds) == 8 and all(0 <= x < 2**63 for x in seeds)
    assert dist_resume.seed_rng(7, rank=2) == dist_resume.derive_seed(7, 2) == torch.initial_seed()
    a = _draw()
    dist_resume.seed_rng(7, rank=2)
    b = _draw()
    assert a[0] == b[0] and torch.equal(a[1], b[1]) and a[2] == b[2]
    dist_resume.seed_rng(7, rank=3)
    assert not torch.equal(torch.rand(3), b[1])


def test_parts_this_process_cannot_restore_are_skipped_loudly(monkeypatch, caplog):
    state = dist_resume.rng_state_dict("cpu")
    state["cuda"] = torch.zeros(16, dtype=torch.uint8)  # as dist_resume 0.2 saved it on a GPU
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dist_resume.load_rng_state_dict(state, "cpu")
        monkeypatch.setitem(sys.modules, "numpy", None)  # numpy not installed here
        dist_resume.load_rng_state_dict(state, "cpu")
        assert dist_resume.rng_state_dict("cpu")["numpy"] is None
    assert "saved cuda RNG stream is not restored: this process runs on cpu" in caplog.text
    if np is not None:  # there was a numpy state to skip
        assert "numpy RNG state is not restored: numpy is not installed" in caplog.text
    with pytest.raises(StateMismatchError, match="'python' and 'torch'"):
        dist_resume.load_rng_state_dict({"torch": torch.get_rng_state()})


# ---------------------------------------------------------------- RNG per accelerator
# torch.accelerator and the device module are faked (tests.helpers.fake_accelerator): these test which stream is
# read, stored and restored. Real device streams are drawn on the test accelerator (tests/accelerator) and on CUDA.


def test_only_the_ranks_own_device_stream_is_saved_under_its_type(monkeypatch):
    fake = fake_accelerator(monkeypatch, "xpu", count=2)
    state = _roundtrip(dist_resume.rng_state_dict(torch.device("xpu", 1)))
    assert fake.rng is not None and fake.rng_reads == [torch.device("xpu", 1)]  # FACTS #12: never every device
    assert state["device"]["type"] == "xpu" and torch.equal(state["device"]["state"], fake.rng[1])
    assert "cuda" not in state
    assert dist_resume.rng_state_dict("cpu")["device"] is None  # a CPU rank has no device stream


def test_a_device_stream_restores_onto_the_ranks_own_device(monkeypatch, caplog):
    fake = fake_accelerator(monkeypatch, "cuda", count=2)
    assert fake.rng is not None
    state = dist_resume.rng_state_dict(torch.device("cuda", 1))
    fake.rng[1] = torch.zeros(8, dtype=torch.uint8)  # the stream moved on
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dist_resume.load_rng_state_dict(state, torch.device("cuda", 1))
    assert torch.equal(fake.rng[1], torch.full((8,), 1, dtype=torch.uint8)) and torch.equal(
        fake.rng[0], torch.zeros(8, dtype=torch.uint8)
    )
    assert "not restored" not in caplog.text
    legacy = {**state, "cuda": state["device"]["state"]}
    del legacy["device"]  # a dist_resume 0.2 file: the bare "cuda" entry
    fake.rng[1] = torch.zeros(8, dtype=torch.uint8)
    dist_resume.load_rng_state_dict(legacy, torch.device("cuda", 1))
    assert torch.equal(fake.rng[1], torch.full((8,), 1, dtype=torch.uint8))


def test_seed_rng_seeds_the_ranks_own_device_only(monkeypatch):
    fake = fake_accelerator(monkeypatch, "cuda", count=2)
    assert fake.rng is not None
    derived = dist_resume.seed_rng(5, rank=1, device=torch.device("cuda", 1))
    assert torch.equal(fake.rng[1], torch.full((8,), derived % 256, dtype=torch.uint8))
    assert torch.equal(fake.rng[0], torch.zeros(8, dtype=torch.uint8)) and fake.current == 0  # index restored


@pytest.mark.parametrize("saved_type", ["cuda", "xpu"])
def test_a_stream_from_another_device_type_restores_the_rest_and_warns_once(monkeypatch, caplog, env, saved_type):
    fake = fake_accelerator(monkeypatch, "xpu" if saved_type == "cuda" else "cuda", count=2)
    saved = _roundtrip({"rank0": dist_resume.rng_state_dict("cpu")})["rank0"]
    saved["device"] = {"type": saved_type, "state": torch.ones(8, dtype=torch.uint8)}
    expected = _draw()
    before = dict(fake.rng or {})
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert _rng.restore_rank_rng([saved], step=3, device=torch.device(fake.type, 0), source="ckpt.pt")
    got = _draw()
    assert got[0] == expected[0] and torch.equal(got[1], expected[1]) and got[2] == expected[2]
    assert fake.rng == before  # the device stream is left alone
    warned = [r.getMessage() for r in caplog.records if "not restored" in r.getMessage()]
    assert warned == [
        f"the saved {saved_type} RNG stream is not restored: this process runs on {fake.type}:0 "
        "(the CPU, Python and numpy streams are restored)"
    ]
    caplog.clear()
    env(RANK=1, WORLD_SIZE=2)  # rank 1 restores as much and says nothing: rank 0 speaks for the job
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dist_resume.load_rng_state_dict(saved, torch.device(fake.type, 1))
    assert "not restored" not in caplog.text


def test_a_backend_without_rng_functions_saves_no_device_stream(monkeypatch, caplog):
    # a device module without RNG functions (as some PrivateUse1 plugins have), faked under a type this machine
    # cannot have: the test accelerator has RNG functions, and it is PrivateUse1 once loaded in this process
    fake_accelerator(monkeypatch, "mtia", count=2, rng=False)
    device = torch.device("mtia", 1)
    state = dist_resume.rng_state_dict(device)
    assert state["device"] is None
    assert dist_resume.seed_rng(1, rank=0, device=device) == dist_resume.derive_seed(1, 0)  # CPU streams only
    state["device"] = {"type": "mtia", "state": torch.ones(8, dtype=torch.uint8)}  # saved where it had them
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        dist_resume.load_rng_state_dict(state, device)
    assert "saved mtia RNG stream is not restored" in caplog.text


@pytest.mark.parametrize(
    "entry, words",
    [
        ({"type": "cuda"}, "a mapping with keys ['type']"),
        ({"type": 3, "state": torch.ones(2)}, "a mapping with keys ['state', 'type']"),
        ([1, 2], "a list"),
    ],
)
def test_a_malformed_device_stream_is_refused_before_any_stream_changes(entry, words):
    state = dist_resume.rng_state_dict("cpu")
    state["device"] = entry
    random.random(), torch.rand(1)  # the live streams differ from the saved ones
    moved = random.getstate(), torch.get_rng_state()
    with pytest.raises(StateMismatchError) as info:
        dist_resume.load_rng_state_dict(state, "cpu")
    assert words in str(info.value) and "{'type': str, 'state': tensor}" in str(info.value)
    assert random.getstate() == moved[0] and torch.equal(torch.get_rng_state(), moved[1])  # nothing restored
    legacy = dist_resume.rng_state_dict("cpu")
    legacy["cuda"], legacy["device"] = [1, 2], None  # a 0.2 "cuda" entry that is no tensor
    with pytest.raises(StateMismatchError, match="got a list"):
        dist_resume.load_rng_state_dict(legacy, "cpu")


def _states(world: int) -> list[dict[str, Any]]:
    out = []
    for rank in range(world):
        dist_resume.seed_rng(11, rank=rank)
        out.append(_roundtrip(dist_resume.rng_state_dict("cpu")))
    return out


@pytest.mark.parametrize("rank,world,saved", [(1, 2, 2), (1, 2, 3), (2, 3, 2), (0, 1, 2)])
def test_world_size_policy(monkeypatch, caplog, rank, world, saved):
    states = _states(saved)
    monkeypatch.setattr(_rng, "rank_and_world", lambda: (rank, world))
    monkeypatch.setattr(_rng, "log_rank0", lambda level, msg, *a: logging.getLogger("dist_resume").log(level, msg, *a))
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        assert _rng.restore_rank_rng(states, step=40, device=torch.device("cpu"), source="ckpt")
    got = torch.rand(3)
    if rank < saved:  # its own saved stream, not rank 0's
        dist_resume.load_rng_state_dict(states[rank])
        assert torch.equal(got, torch.rand(3))
    else:  # a new rank: derived from the saved seed, its rank and the step
        assert torch.initial_seed() == dist_resume.derive_seed(11, rank, 40)
    if world == saved:
        assert not caplog.records
    else:
        assert caplog.records[0].levelno == logging.WARNING
        assert f"holds RNG state for {saved} rank(s) but the job has {world}" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        assert not _rng.restore_rank_rng(None, step=1, device=None, source="old.pt")
    assert "old.pt holds no RNG state" in caplog.text


def test_samplers_that_disagree_are_refused():
    ok = {"epoch": 0, "consumed": 8}
    assert _rank_states.merge_rank_states([{"rng": None, "sampler": ok}] * 2) == (None, ok)
    with pytest.raises(StateMismatchError, match=r"\[\(0, 8\), \(0, 10\)\]"):
        _rank_states.merge_rank_states([{"rng": None, "sampler": ok}, {"rng": None, "sampler": {**ok, "consumed": 10}}])


# ---------------------------------------------------------------- save_checkpoint / resume plumbing


def _setup() -> tuple[torch.nn.Sequential, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_save_and_resume_restore_sampler_and_rng(tmp_path):
    model, opt = _setup()
    sampler = Sampler(10, 1, 0, seed=4)
    it = iter(sampler)
    next(it), next(it), next(it)
    path = tmp_path / "c.pt"
    dist_resume.seed_rng(5, rank=0)
    dist_resume.save_checkpoint(path, model=model, optimizer=opt, step=3, epoch=0, dataloader=sampler)
    expected = (model(torch.ones(2, 4)), list(it))
    raw = torch.load(path, weights_only=True)
    assert len(raw["rng"]) == 1 and raw["sampler"]["consumed"] == 3

    model2, opt2 = _setup()
    sampler2 = Sampler(10, 1, 0, seed=4)
    res = dist_resume.resume(
        path, model=model2, optimizer=opt2, dataloader=sampler2, options=dist_resume.ResumeOptions(rng=True)
    )
    assert res.restored[-2:] == ("sampler", "rng")
    assert torch.equal(model2(torch.ones(2, 4)), expected[0])  # same dropout mask
    assert list(sampler2) == expected[1]

    plain = dist_resume.resume(path, model=model2, optimizer=opt2)  # rng=True is the default, as on save
    assert plain.restored[-1] == "rng"
    assert torch.equal(model2(torch.ones(2, 4)), expected[0])  # the same streams again
    off = dist_resume.resume(path, model=model2, optimizer=opt2, options=dist_resume.ResumeOptions(rng=False))
    assert "rng" not in off.restored and "rng" not in off.skipped


def test_a_dataloader_over_the_sampler_is_its_data_position_and_one_without_is_refused(tmp_path):
    model, opt = _setup()
    sampler = Sampler(10, 1, 0, seed=4)
    loader = torch.utils.data.DataLoader(dataset_of(list(range(10))), batch_size=3, sampler=sampler)
    next(iter(loader))
    path = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, step=1, dataloader=loader)
    assert torch.load(path, weights_only=True)["sampler"]["consumed"] == 3
    batches = torch.utils.data.DataLoader(
        dataset_of(list(range(10))),
        batch_sampler=torch.utils.data.BatchSampler(Sampler(10, 1, 0, seed=4), 3, drop_last=False),
    )
    res = dist_resume.resume(path, model=model, optimizer=opt, dataloader=batches)  # batch_sampler.sampler
    batch_sampler = batches.batch_sampler
    assert isinstance(batch_sampler, torch.utils.data.BatchSampler) and isinstance(batch_sampler.sampler, Sampler)
    assert "sampler" in res.restored and batch_sampler.sampler.consumed == 3
    plain = torch.utils.data.DataLoader(dataset_of(list(range(10))), batch_size=3, shuffle=True)
    with pytest.raises(dist_resume.errors.UsageError, match="whose sampler is RandomSampler") as info:
        dist_resume.resume(path, model=model, dataloader=plain)
    assert "ResumableDistributedSampler" in info.value.hint
    with pytest.raises(dist_resume.errors.UsageError, match=r"dataloader= is builtins\.list"):
        dist_resume.save_checkpoint(tmp_path / "d.pt", model=model, dataloader=[1, 2])
    with pytest.raises(dist_resume.errors.UsageError, match="not a DataLoader"):  # a state dict saves, never restores
        dist_resume.resume(path, model=model, dataloader=sampler.state_dict())


def test_resume_refuses_a_foreign_sampler_state_before_changing_anything(tmp_path):
    model, opt = _setup()
    path = tmp_path / "c.pt"
    dist_resume.save_checkpoint(path, model=model, optimizer=opt, step=1, dataloader=Sampler(10, 1, 0, seed=4))
    dist_resume.save_checkpoint(tmp_path / "none.pt", model=model, optimizer=opt, step=1, rng=False)
    assert "rng" not in torch.load(tmp_path / "none.pt", weights_only=True)
    target, opt2 = _setup()
    with torch.no_grad():
        target.get_parameter("0.weight").add_(1.0)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(StateMismatchError, match="seed 4 saved, 5 now"):
        dist_resume.resume(path, model=target, optimizer=opt2, dataloader=Sampler(10, 1, 0, seed=5))
    with pytest.raises(StateMismatchError, match=r"has no sampler state but a sampler was passed.*no dataloader="):
        dist_resume.resume(tmp_path / "none.pt", model=target, optimizer=opt2, dataloader=Sampler(10, 1, 0))
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())
    res = dist_resume.resume(
        tmp_path / "none.pt",
        model=target,
        optimizer=opt2,
        dataloader=Sampler(10, 1, 0),
        options=dist_resume.ResumeOptions(strict=False, rng=True),
    )
    assert "sampler" in res.skipped and "rng" not in res.restored
