"""Random draws made while loading data, inside DataLoader workers, are made again after a resume.

The dataset draws from the worker's global streams as augmentation does (torch's, Python's ``random``, NumPy's) and a
``collate_fn`` mixes the batch with a torch draw (mixup); neither knows dist_resume. A run registered with a
``CheckpointManager`` (plain ``DataLoader`` with workers, persistent or not, and torchdata's ``StatefulDataLoader``)
is stopped mid-epoch and at an epoch's end, resumed in new objects, and compared batch by batch, bitwise, with an
uninterrupted run. The same under torchrun at 2 and 4 ranks: tests/dist/test_reference_trainer.py.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, default_collate

import dist_resume
from dist_resume import ResumableDistributedSampler as Sampler
from dist_resume._exact.sample_streams import SampleIndex, seeded_items, stream_seed

N, BATCH = 20, 4  # one rank: 5 batches an epoch


class Augmented(Dataset[torch.Tensor]):
    """Sample ``i`` is ``i`` plus draws from the loading process's own global streams, as transforms make them."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item(), random.random(), float(np.random.rand())])


def mixup(samples: list[torch.Tensor]) -> torch.Tensor:
    """A collate_fn that draws, as torchvision's RandomMixup does in the workers."""
    batch = default_collate(samples)
    lam = torch.rand(())
    return torch.cat([batch, (lam * batch + (1 - lam) * batch.roll(1, 0))[:, 1:]], dim=1)


LOADERS: dict[str, dict[str, Any]] = {
    "workers": {"num_workers": 2, "prefetch_factor": 2},
    "persistent workers": {"num_workers": 2, "persistent_workers": True},
    "StatefulDataLoader, workers": {"num_workers": 2, "stateful": True},
}


def _loader(streams: bool = True, **options: Any) -> DataLoader[torch.Tensor]:
    sampler = Sampler(N, num_replicas=1, rank=0, seed=3, sample_streams=streams)
    if options.pop("stateful", False):
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(Augmented(), batch_size=BATCH, sampler=sampler, collate_fn=mixup, **options)  # type: ignore[no-any-return]
    return DataLoader(Augmented(), batch_size=BATCH, sampler=sampler, collate_fn=mixup, **options)


def _train(make: Callable[[], DataLoader[torch.Tensor]], folder: Path, stop: int | None = None) -> list[torch.Tensor]:
    """Three epochs as a user writes them, a save every step; at step ``stop`` return (as if killed)."""
    torch.manual_seed(0)
    loader, model = make(), torch.nn.Linear(1, 1)
    with dist_resume.CheckpointManager(folder, model=model, dataloader=loader, keep_last=2) as mgr:
        res = mgr.resume()
        step, seen = (res.step or 0) if res is not None else 0, []
        while loader.sampler.epoch < 3:  # type: ignore[attr-defined]
            for batch in loader:
                step += 1
                seen.append(batch)
                mgr.save(step)
                if step == stop:
                    return seen
    return seen


@pytest.mark.parametrize("case", LOADERS)
def test_draws_inside_workers_and_collate_are_made_again_after_a_resume(tmp_path, case):
    if LOADERS[case].get("stateful"):
        pytest.importorskip("torchdata.stateful_dataloader")
    make = lambda: _loader(**LOADERS[case])  # noqa: E731
    reference = _train(make, tmp_path / "reference")
    assert len(reference) == 15 and len({round(float(b[0, 1]), 6) for b in reference}) == 15  # draws, each new
    for stop in (3, 5, 7):  # mid-epoch (workers prefetched ahead), an epoch's last batch, the next epoch
        folder = tmp_path / f"stop{stop}"
        resumed = _train(make, folder, stop=stop) + _train(make, folder)
        assert len(resumed) == len(reference)
        for step, (got, want) in enumerate(zip(resumed, reference, strict=True), 1):
            assert torch.equal(got, want), f"{case}: stopped at {stop}, step {step} differs"


def test_the_draws_are_the_same_with_any_number_of_workers_and_opting_out_gives_torchs(tmp_path):
    one = _train(lambda: _loader(num_workers=1), tmp_path / "one")
    two = _train(lambda: _loader(num_workers=2, prefetch_factor=3), tmp_path / "two")
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    reference = _train(lambda: _loader(streams=False, num_workers=2), tmp_path / "torch")
    resumed = _train(lambda: _loader(streams=False, num_workers=2), tmp_path / "out", stop=3)
    resumed += _train(lambda: _loader(streams=False, num_workers=2), tmp_path / "out")
    assert [b[:, 0].tolist() for b in resumed] == [b[:, 0].tolist() for b in reference]  # the samples: exact
    assert not torch.equal(resumed[3], reference[3])  # sample_streams=False: the workers' own streams, not saved


def test_each_sample_gets_its_own_stream_and_each_batch_a_collate_stream():
    dataset = Augmented()
    batch = [SampleIndex(i, stream_seed(3, 0, i)) for i in (4, 9)]
    first = seeded_items(dataset, batch)
    after = torch.rand(())  # the collate stream
    assert [s[0].item() for s in first] == [4.0, 9.0]
    again = seeded_items(dataset, list(reversed(batch)))  # another batch: each sample's draws follow it
    assert [s.tolist() for s in again] == [s.tolist() for s in reversed(first)]
    assert not torch.equal(torch.rand(()), after)  # another batch's collate stream
    assert stream_seed(3, 0, 4) != stream_seed(3, 1, 4) != stream_seed(4, 0, 4)  # epoch and seed count
    assert seeded_items(dataset, [4, 9])[0][0].item() == 4.0  # untagged indices load as torch loads them
