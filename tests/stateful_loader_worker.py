"""A process that saves, or restores, StatefulDataLoader states mid-epoch (tests/test_stateful_loader.py runs it).

    python -m tests.stateful_loader_worker save OUT.pt
    python -m tests.stateful_loader_worker restore OUT.pt RESULT.json

Ranks are simulated in one process (each rank's loader has its own sampler partition and 2 workers that prefetch 4
batches each); the loader functions under test are local, so no process group is needed. ``save`` runs epoch 0 in full
and epoch 1 for 3 batches per rank, then writes every rank's entry (for a ResumableDistributedSampler and a plain
DistributedSampler) with the indices trained on. ``restore`` loads them in a new process, at world size 2 and 3, and
finishes epoch 1 and runs epoch 2, writing what each rank saw (or the refusal).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from dist_resume import DistResumeError, ResumableDistributedSampler
from dist_resume._exact import stateful_loader as sl

N, BATCH, WORKERS, PREFETCH, SEED, TRAINED = 60, 2, 2, 4, 3, 3
KINDS = {"resumable": ResumableDistributedSampler, "distributed": DistributedSampler}


def loaders(kind: str, world: int) -> list[Any]:
    data = list(range(N))
    out = []
    for rank in range(world):
        sampler = KINDS[kind](data, num_replicas=world, rank=rank, seed=SEED)
        out.append(
            StatefulDataLoader(data, batch_size=BATCH, sampler=sampler, num_workers=WORKERS, prefetch_factor=PREFETCH)
        )
    return out


def epoch_of(loader: Any, kind: str, epoch: int) -> list[int]:
    if kind == "distributed":
        loader.sampler.set_epoch(epoch)
    return [i for batch in loader for i in batch.tolist()]


def save(out: str) -> None:
    saved: dict[str, Any] = {}
    for kind in KINDS:
        ranks = loaders(kind, 2)
        for loader in ranks:
            epoch_of(loader, kind, 0)
        its = []
        for loader in ranks:
            if kind == "distributed":
                loader.sampler.set_epoch(1)
            its.append(iter(loader))
        trained = [[i for _ in range(TRAINED) for i in next(it).tolist()] for it in its]
        entries = sl.merge_loader_states([sl.loader_state(loader) for loader in ranks])
        saved[kind] = {"entries": entries, "trained": trained}
        del its
    torch.save(saved, out)


def restore(path: str, result: str) -> None:
    saved = torch.load(path, weights_only=True)  # the entries are plain values
    report: dict[str, Any] = {}
    for kind in KINDS:
        for world in (2, 3):
            ranks = loaders(kind, world)
            try:
                plans = [sl.check_loader_state(loader, saved[kind]["entries"], source="ckpt") for loader in ranks]
            except DistResumeError as err:
                report[f"{kind}/{world}"] = {"refused": f"{type(err).__name__}: {err}"}
                continue
            for plan in plans:
                sl.restore_loader(plan)
            rest = [[i for batch in loader for i in batch.tolist()] for loader in ranks]  # the rest of epoch 1
            nxt = [epoch_of(loader, kind, 2) for loader in ranks]
            report[f"{kind}/{world}"] = {
                "modes": [p.mode.value for p in plans],
                "trained": saved[kind]["trained"],
                "rest": rest,
                "next_epoch": nxt,
            }
    with open(result, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "save":
        save(sys.argv[2])
    else:
        restore(sys.argv[2], sys.argv[3])
