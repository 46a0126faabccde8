"""What a save records in ``meta`` for ``dist-resume check`` to read as evidence (dist_resume/_save/evidence.py): a data
position that counts the batches DataLoader workers prefetched, and a model saved from DDP; nothing where the
position counts only what the loop took. The diagnosis that reads them: tests/test_check_diagnose.py."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import dist_resume as dr
from dist_resume._exact.loaders import prefetch_warning
from dist_resume._exact.sampler import PREFETCH_WARNING
from tests.models import single_rank_group

N, BATCH = 32, 4


def _loader(**options: Any) -> DataLoader[Any]:
    sampler = dr.ResumableDistributedSampler(N, num_replicas=1, rank=0, seed=3)
    return DataLoader(TensorDataset(torch.arange(N)), batch_size=BATCH, sampler=sampler, **options)


def _meta_after_two_steps(
    tmp_path: Path, loader: DataLoader[Any], data: Callable[[DataLoader[Any]], Any] | None = None
) -> dict[str, Any]:
    """Two steps of ``loader``, saved with ``dataloader=data(loader)`` (the loader itself by default): the
    checkpoint's meta."""
    model = torch.nn.Linear(1, 1)
    path = tmp_path / "c.pt"
    for step, _ in enumerate(loader, 1):
        if step == 2:
            given = loader if data is None else data(loader)
            dr.save_checkpoint(path, model=model, dataloader=given, step=step)
            break
    meta: dict[str, Any] = torch.load(path, weights_only=True)["meta"]
    return meta


def test_a_position_that_counts_prefetched_batches_is_recorded_with_the_first_saves_warning(tmp_path: Path) -> None:
    # in_order=False: the loader's batches cannot be counted in samples, so its position is the sampler's own
    loader = _loader(num_workers=2, in_order=False)
    meta = _meta_after_two_steps(tmp_path, loader)
    text = prefetch_warning(loader)
    assert text is not None and meta["data_position_prefetched"] == {
        "workers": 2,
        "prefetch_factor": 2,
        "warning": text,
    }
    # the sampler registered alone, drawn by a loader with workers: it saw them draw
    meta = _meta_after_two_steps(tmp_path, _loader(num_workers=2, prefetch_factor=3), lambda lo: lo.sampler)
    assert meta["data_position_prefetched"] == {
        "workers": 2,
        "prefetch_factor": 3,
        "warning": PREFETCH_WARNING % (2, 3),
    }
    assert "ddp" not in meta


def test_a_position_that_counts_what_the_loop_took_records_nothing(tmp_path: Path) -> None:
    for loader, data in (
        (_loader(), None),  # no workers
        (_loader(num_workers=2, persistent_workers=True), None),  # the save counts the live iterator's batches
        (_loader(num_workers=2), lambda lo: lo.sampler.state_dict(consumed=2 * BATCH)),  # counted by the script
    ):
        assert "data_position_prefetched" not in _meta_after_two_steps(tmp_path, loader, data)


def test_a_model_saved_from_ddp_is_recorded(tmp_path: Path) -> None:
    with single_rank_group(tmp_path):
        ddp = DistributedDataParallel(torch.nn.Linear(2, 2))
        path = dr.save_checkpoint(tmp_path / "ddp.pt", model=ddp, step=1)
    assert torch.load(path, weights_only=True)["meta"]["ddp"] is True
    plain = dr.save_checkpoint(tmp_path / "plain.pt", model=torch.nn.Linear(2, 2), step=1)
    assert "ddp" not in torch.load(plain, weights_only=True)["meta"]
