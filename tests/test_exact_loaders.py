"""Exact resume as loops are written, in one process: DataLoaders without ``generator=``, with workers, torchdata's
StatefulDataLoader, the DDP tutorial's peek and ``set_epoch``, saves in an epoch's last batches, random augmentation
in workers. Each case trains an uninterrupted run and one stopped at a save and resumed from it in fresh objects, and
compares what every step saw: its samples, and one draw of the global RNG (as dropout draws). The same cases under
torchrun with 2 ranks, killed and relaunched, are tests/dist/test_user_loops.py's."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset

import dist_resume
from dist_resume import ResumableDistributedSampler as Sampler

N, BATCH = 24, 4  # one rank: 6 batches an epoch


class Noisy(Dataset[torch.Tensor]):
    """Sample ``i`` is ``i`` plus noise seeded by ``dist_resume.sample_seed(i)`` (or, ``own``, drawn from the
    loading process's own stream: a worker's, which no checkpoint holds)."""

    def __init__(self, own: bool = False) -> None:
        self.own = own

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        g = None if self.own else torch.Generator().manual_seed(dist_resume.sample_seed(i))
        return i + torch.rand((), generator=g)


def _loader(kind: str, batch_sampler: bool = False, **options: Any) -> DataLoader[torch.Tensor]:
    """``batch_sampler``: batches from torch's ``BatchSampler`` over the sampler (``batch_sampler=``, no
    ``batch_size=``), which neither the loader's ``sampler`` attribute nor torchdata's state sees."""
    sampler = Sampler(N, num_replicas=1, rank=0, seed=3)
    batching: dict[str, Any] = (
        {"batch_sampler": BatchSampler(sampler, BATCH, drop_last=False)}
        if batch_sampler
        else {"batch_size": BATCH, "sampler": sampler}
    )
    if kind == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Noisy(), **batching, **options)  # type: ignore[no-any-return]
    own = options.pop("own", False)
    return DataLoader(Noisy(own), **batching, **options)


def _train(make: Callable[[], DataLoader[torch.Tensor]], peek: bool, path: Path, stop: int | None = None) -> list[Any]:
    """Three epochs of a loop as users write them; at step ``stop`` save to ``path`` and return. Resumes from ``path``
    when it exists. Each step gives (its samples, one draw of the global stream)."""
    torch.manual_seed(0)
    loader, model = make(), torch.nn.Linear(1, 1)
    sampler = getattr(loader.batch_sampler, "sampler", loader.sampler)
    assert isinstance(sampler, Sampler)
    res = dist_resume.resume(path, model=model, dataloader=loader) if path.exists() else None
    step, seen = ((res.step or 0) if res is not None else 0), []

    def train(batch: torch.Tensor) -> bool:
        nonlocal step
        step += 1
        seen.append((batch.int().tolist(), torch.rand(()).item(), batch.tolist()))  # samples, dropout, noise
        if step == stop:
            dist_resume.save_checkpoint(path, model=model, dataloader=loader, step=step)
        return step == stop

    if peek:  # PyTorch's DDP tutorial
        for epoch in range((res.epoch or 0) if res is not None else 0, 3):
            assert len(next(iter(loader))) == BATCH
            sampler.set_epoch(epoch)
            if any(train(batch) for batch in loader):
                return seen
    else:
        while sampler.epoch < 3:
            if any(train(batch) for batch in loader):
                return seen
    return seen


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "no generator, num_workers=0": ("plain", {}),
    "persistent workers": ("plain", {"num_workers": 2, "persistent_workers": True, "prefetch_factor": 2}),
    "StatefulDataLoader, num_workers=0": ("stateful", {}),
    "StatefulDataLoader, workers": ("stateful", {"num_workers": 2, "prefetch_factor": 3}),
    "StatefulDataLoader, persistent workers": ("stateful", {"num_workers": 2, "persistent_workers": True}),
    "batch_sampler=, no generator, num_workers=0": ("plain", {"batch_sampler": True}),
    "StatefulDataLoader, batch_sampler=, num_workers=0": ("stateful", {"batch_sampler": True}),
    "StatefulDataLoader, batch_sampler=, workers": ("stateful", {"batch_sampler": True, "num_workers": 2}),
}


@pytest.mark.parametrize("peek", [False, True], ids=["loop", "peek"])
@pytest.mark.parametrize("case", CASES)
def test_a_run_stopped_and_resumed_sees_what_an_uninterrupted_run_sees(tmp_path, case, peek):
    """Stops mid-epoch, in the batches the workers drew ahead (the sampler already in the next epoch), and after an
    epoch's last batch; each resumed in new objects ends as the uninterrupted run does."""
    pytest.importorskip("torchdata.stateful_dataloader")
    kind, options = CASES[case]
    make = functools.partial(_loader, kind, **options)
    reference = _train(make, peek, tmp_path / "none.pt")
    assert len(reference) == 18
    # torch's DataLoader gives a resumed epoch's workers other seeds
    noise = kind == "stateful" or not options.get("num_workers")
    for stop in (3, 11, 12):
        path = tmp_path / f"stop{stop}.pt"
        first = _train(make, peek, path, stop=stop)
        assert torch.load(path, weights_only=True)["meta"]["epoch"] == stop // 6, "the epoch the loop continues in"
        resumed = first + _train(make, peek, path)
        assert [s[:2] for s in resumed] == [s[:2] for s in reference], f"stopped at step {stop}"
        assert ([s[2] for s in resumed] == [s[2] for s in reference]) is noise, f"stopped at step {stop}"


def test_a_resume_draws_what_the_uninterrupted_run_draws_and_a_worker_stream_is_not_saved(tmp_path):
    """Draws seeded by sample_seed inside StatefulDataLoader workers are made again after a resume; draws from a
    worker's own stream are not (what docs/exact-resume.md says); torch's DataLoader gives its workers other seeds
    after a resume."""
    pytest.importorskip("torchdata.stateful_dataloader")
    for kind, own, same in [("stateful", False, True), ("plain", True, False)]:
        options: dict[str, Any] = {"num_workers": 2}
        options |= {"persistent_workers": True, "own": own} if kind == "plain" else {}
        make = functools.partial(_loader, kind, **options)
        reference = _train(make, False, tmp_path / "none.pt")
        path = tmp_path / f"{kind}.pt"
        resumed = _train(make, False, path, stop=4) + _train(make, False, path)
        assert [s[:2] for s in resumed] == [s[:2] for s in reference], f"{kind}: samples and the main stream"
        assert (resumed[4][2] == reference[4][2]) is same, f"{kind}: the worker-side draws of the resumed epoch"


class Pairs:
    """A batch sampler of one's own: pairs of the sampler's indices, with no ``state_dict``."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Any:
        it = iter(self.sampler)
        return iter(lambda: [i for _, i in zip(range(2), it)] or None, None)

    def __len__(self) -> int:
        return (len(self.sampler) + 1) // 2


def test_a_stateful_loader_whose_batch_sampler_cannot_be_counted_is_warned_once(tmp_path, caplog):
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    loader = stateful.StatefulDataLoader(Noisy(), batch_sampler=Pairs(Sampler(N, num_replicas=1, rank=0, seed=3)))
    model = torch.nn.Linear(1, 1)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        for step, _ in enumerate(loader, 1):
            dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, dataloader=loader, step=step)
            if step == 3:
                break
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "batch_sampler (Pairs) has no state_dict()" in warned[0], warned


def test_a_plain_dataloader_whose_workers_prefetch_is_warned_at_the_first_save_with_the_fixes(tmp_path, caplog):
    loader = _loader("plain", num_workers=2, prefetch_factor=2)
    model = torch.nn.Linear(1, 1)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        for step, _ in enumerate(loader, 1):
            path = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, dataloader=loader, step=step)
            if step == 2:
                break
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1, warned
    for fix in ("persistent_workers=True", "StatefulDataLoader", "dataloader=sampler.state_dict(consumed="):
        assert fix in warned[0]
    sampler = loader.sampler
    assert isinstance(sampler, Sampler)
    saved = torch.load(path, weights_only=True)["sampler"]
    assert (saved["epoch"], saved["consumed"]) > (0, 2 * BATCH)  # ahead: what the workers drew
    exact = sampler.state_dict(consumed=2 * BATCH)  # the way around it, also once the sampler moved on
    dist_resume.save_checkpoint(path, model=model, dataloader=exact, step=2)
    assert torch.load(path, weights_only=True)["sampler"]["consumed"] == 2 * BATCH


def test_epoch_given_as_the_samplers_while_the_loop_is_elsewhere_is_said_once(tmp_path, caplog, monkeypatch):
    from dist_resume._exact import data

    monkeypatch.setattr(data, "_warned_epoch", False)
    loader = _loader("plain")
    model = torch.nn.Linear(1, 1)
    sampler = loader.sampler
    assert isinstance(sampler, Sampler)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        for step, _ in enumerate(loader, 1):  # the last batch: the loop continues in epoch 1, the sampler says 0
            if step == 6:
                for _ in range(2):
                    dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, dataloader=loader, epoch=sampler.epoch)
    assert torch.load(tmp_path / "c.pt", weights_only=True)["meta"]["epoch"] == 0  # what was given is saved
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "save(epoch=0) records the sampler's epoch" in warned[0], warned
    assert "loop continues in epoch 1" in warned[0] and "Pass no epoch=" in warned[0]


def test_a_failed_resume_leaves_the_loader_as_it_was(tmp_path, monkeypatch):
    """The data position is one of apply's steps: a fault after it puts the sampler back, and the loader's next
    iterator draws from the global RNG as torch's own (a resumed position would have made it skip that draw)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    for kind in ("plain", "stateful"):
        path, saving = tmp_path / f"{kind}.pt", _loader(kind)
        model = torch.nn.Linear(1, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        batches = iter(saving)
        next(batches), next(batches), next(batches)
        dist_resume.save_checkpoint(path, model=model, optimizer=opt, dataloader=saving, step=3)  # mid-epoch 0
        loader = _loader(kind)

        def broken(self: Any, state: Any) -> None:
            raise RuntimeError("injected")

        monkeypatch.setattr(torch.optim.SGD, "load_state_dict", broken)
        with pytest.raises(dist_resume.errors.RestoreError, match="injected"):
            dist_resume.resume(path, model=model, optimizer=opt, dataloader=loader)
        monkeypatch.undo()
        torch.manual_seed(5)
        iter(_loader(kind))  # torch's own iterator creation draws one number from the global stream
        after_torch = torch.rand(())
        torch.manual_seed(5)
        iter(loader)
        assert torch.equal(torch.rand(()), after_torch), kind
        sampler = loader.sampler
        assert isinstance(sampler, Sampler) and (sampler.epoch, sampler.consumed) == (0, 0), kind
        assert [int(i) for i in next(iter(loader))] == list(Sampler(N, 1, 0, seed=3))[:BATCH]


def test_a_position_saved_by_one_kind_of_loader_resumes_into_the_other(tmp_path):
    """A plain DataLoader's position resumes a StatefulDataLoader (through its sampler), and the reverse."""
    pytest.importorskip("torchdata.stateful_dataloader")
    for saved_by, resumed_by in (("plain", "stateful"), ("stateful", "plain")):
        path = tmp_path / f"{saved_by}.pt"
        first = _train(functools.partial(_loader, saved_by), False, path, stop=4)
        rest = _train(functools.partial(_loader, resumed_by), False, path)
        reference = _train(functools.partial(_loader, resumed_by), False, tmp_path / "none.pt")
        assert [s[0] for s in first + rest] == [s[0] for s in reference], f"{saved_by} -> {resumed_by}"


def test_a_persistent_loaders_position_after_set_epoch_is_the_samplers(caplog):
    from dist_resume._exact.data import stateful_data

    loader = _loader("plain", num_workers=2, persistent_workers=True)
    position = stateful_data(loader, saving=True)
    batches = iter(loader)
    next(batches), next(batches)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert position.state_dict()["consumed"] == 2 * BATCH  # what the loop got, not what the workers drew
        loader.sampler.set_epoch(3)  # type: ignore[attr-defined]
        assert (position.state_dict()["epoch"], position.state_dict()["consumed"]) == (3, 0)
    assert not caplog.records  # exact: nothing to warn about


@pytest.mark.parametrize("kind", ["plain", "stateful"])
def test_an_iterator_the_loop_drops_ends_its_workers_at_once_after_a_resume(tmp_path, kind):
    """The DDP tutorial's peek after a resume: the dropped iterator (the loader's hooks count its batches) is freed as
    torch's own are (a StatefulDataLoader keeps its newest iterator until it creates the next), and its workers end
    with it, and so is the loader once dropped; kept until a garbage collection, torch's shutdown would wait its 5-s
    join timeout for each worker."""
    if kind == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    import gc
    import weakref

    loader = _loader(kind, num_workers=2)
    model = torch.nn.Linear(1, 1)
    dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, dataloader=loader, step=0)
    dist_resume.resume(tmp_path / "c.pt", model=model, dataloader=loader)
    gc.disable()
    try:
        for _ in range(2):  # the resumed epoch's iterator, then one created as torch's own
            peeked = iter(loader)
            next(peeked)
            gone, workers = weakref.ref(peeked), list(peeked._workers)  # type: ignore[attr-defined]
            del peeked
            following = iter(loader)
            assert gone() is None, "the dropped iterator is kept alive by a reference cycle"
            for worker in workers:
                worker.join(timeout=2)
            assert [w.exitcode for w in workers] == [0, 0]
            del following
        loader_gone = weakref.ref(loader)
        del loader  # as a run's loader when its function returns: the hooks it holds do not keep it
        assert loader_gone() is None, "the dropped loader is kept alive by a reference cycle"
    finally:
        gc.enable()
