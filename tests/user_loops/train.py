#!/usr/bin/env python
"""A training script written as users write them, one flag per way of building the data loader and the loop.

    torchrun --standalone --nproc_per_node=2 tests/user_loops/train.py DIR [--loader plain|stateful]
        [--workers N] [--persistent] [--prefetch P] [--peek] [--batch-sampler] [--augment] [--save-tail N]

DDP over a small MLP with dropout, AdamW and a StepLR scheduler, a ``DataLoader`` **without** ``generator=`` (as
PyTorch's tutorial writes it) over a ``ResumableDistributedSampler``, everything registered once with a
``CheckpointManager`` in DIR, which resumes from DIR's newest checkpoint when there is one. Only the public API.

- ``--loader stateful``: torchdata's ``StatefulDataLoader`` in place of torch's ``DataLoader``;
- ``--workers``, ``--persistent``, ``--prefetch``: the loader's ``num_workers``, ``persistent_workers`` and
  ``prefetch_factor``;
- ``--peek``: the loop of PyTorch's DDP tutorial (``multigpu_torchrun.py``): every epoch reads one batch to learn the
  batch size (``next(iter(loader))``), then calls ``sampler.set_epoch(epoch)``, then iterates;
- ``--batch-sampler``: batches from ``batch_sampler=BatchSampler(sampler, BATCH)`` in place of ``batch_size=`` and
  ``sampler=``;
- ``--augment``: the dataset adds noise to each sample in ``__getitem__`` (in the loader's workers when it has
  some), drawn from a generator seeded with ``dist_resume.sample_seed(index)``;
- ``--save-tail N``: save only in the last N batches of each epoch (default: every 3 steps);
- ``--log-samples``: append each step's sample indices to ``DIR/samples_<rank>`` (JSON lines).

It saves once more after its last step. ``--step-time`` (seconds, default 0.05) stands for the work of a step, so that a
run lasts long enough to be interrupted mid-epoch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import BatchSampler, DataLoader, Dataset

import dist_resume as dr

SAMPLES, FEATURES, BATCH = 64, 8, 4  # 2 ranks: 8 steps an epoch


class Points(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, augment: bool) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = torch.randint(0, 4, (SAMPLES,), generator=g)
        self.augment = augment

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x = self.x[index]
        if self.augment:  # random per sample, reproduced after a resume: see docs/exact-resume.md
            g = torch.Generator().manual_seed(dr.sample_seed(index))
            x = x + 0.1 * torch.randn(x.shape, generator=g)
        return x, self.y[index], index


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--loader", choices=["plain", "stateful"], default="plain")
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--persistent", action="store_true")
    p.add_argument("--prefetch", type=int, default=None)
    p.add_argument("--peek", action="store_true")
    p.add_argument("--batch-sampler", action="store_true", help="batch_sampler=BatchSampler(sampler, BATCH)")
    p.add_argument("--augment", action="store_true")
    p.add_argument("--save-tail", type=int, default=0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--step-time", type=float, default=0.05)
    p.add_argument("--log-samples", action="store_true", help="append each step's samples to DIR/samples_<rank>")
    args = p.parse_args()

    info = dr.init_distributed()
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4))
    if info.is_distributed:
        model = DistributedDataParallel(model)
    dr.seed_rng(0)  # then one stream per rank (dropout): python, torch and numpy, all reproducible
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.5)

    dataset = Points(args.augment)
    sampler = dr.ResumableDistributedSampler(dataset, seed=0)
    options = {"num_workers": args.workers}
    if args.workers:
        options |= {"persistent_workers": args.persistent, "prefetch_factor": args.prefetch}
    batching = (
        {"batch_sampler": BatchSampler(sampler, BATCH, drop_last=False)}
        if args.batch_sampler
        else {"batch_size": BATCH, "sampler": sampler}
    )
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader: DataLoader = StatefulDataLoader(dataset, **batching, **options)
    else:
        loader = DataLoader(dataset, **batching, **options)

    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt, scheduler=sched, dataloader=loader, keep_last=3)
    res = mgr.resume()
    step = (res.step or 0) if res is not None else 0  # optimizer steps completed
    log = open(Path(args.folder, f"samples_{info.rank}"), "a", buffering=1) if args.log_samples else None
    saved = step
    per_epoch = -(-SAMPLES // info.world_size // BATCH)  # batches a rank trains on in an epoch

    def train(x: torch.Tensor, y: torch.Tensor, index: torch.Tensor) -> None:
        nonlocal step, saved
        if log is not None:
            log.write(json.dumps({"step": step + 1, "indices": index.tolist()}) + "\n")
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        step += 1
        time.sleep(args.step_time)
        in_epoch = (step - 1) % per_epoch + 1
        if (in_epoch > per_epoch - args.save_tail) if args.save_tail else step % 3 == 0:
            mgr.save(step)  # on every rank; the epoch saved is the loop's
            saved = step

    if args.peek:  # PyTorch's DDP tutorial: peek a batch, set_epoch, iterate
        for epoch in range((res.epoch or 0) if res is not None else 0, args.epochs):  # the epoch it continues in
            batch_size = len(next(iter(loader))[0])
            assert batch_size == BATCH
            sampler.set_epoch(epoch)
            for batch in loader:
                train(*batch)
    else:
        while sampler.epoch < args.epochs:  # continues mid-epoch, then moves on by itself
            for batch in loader:
                train(*batch)
    if saved != step:
        mgr.save(step)
    mgr.close()
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
