"""A training script written as users write them, for ``dist-resume check``: ``python train.py DIR [--bug BUG]``.

One process, or any number under torchrun (gloo on the CPU; ``<accelerator>:LOCAL_RANK`` with its backend when torch
reports one, as under ``dist-resume check --device sim``). A dropout MLP, AdamW and a decaying LambdaLR, a
``ResumableDistributedSampler``, a ``CheckpointManager`` in DIR saving every 4 steps: resumed at any checkpoint it ends
bitwise equal to an uninterrupted run. Each step also waits ``--step-seconds`` (default 0.025 s: a step of real
training, so that a checkpoint appears every 0.1 s, not every millisecond). ``--bug`` plants one of the mistakes the
check must find (repeatable):

    scheduler   the scheduler is not registered with the CheckpointManager
    rng         resume() leaves the RNG streams alone (ResumeOptions(rng=False))
    sampler     the DataLoader is not registered: a resumed run starts its epoch over
    generator   the DataLoader has no generator= and the manager gets its sampler, not the DataLoader: each new
                iterator draws from the global RNG, and a resumed epoch creates one more (given as dataloader=, the
                same loader is exact)
    held-batch  the next step's batch is drawn before the save and held in a variable (as nanoGPT's loop prefetches
                its next batch): the saved data position counts it, and a resumed run never trains it
    eval-rank0  rank 0 evaluates right after each save on a random subset (torch.randint from its global stream),
                between the save and the next step: a resumed run does not redo that evaluation
    prefetch    the DataLoader as torchvision's detection reference builds it: 2 workers (not persistent), no
                generator=, and a batch sampler of its own (its GroupedBatchSampler) whose batches the save cannot
                count: the saved position counts the batches the workers prefetched, and a resumed run skips them
    fail        raises before training (a script that fails on its own)

``--torch-seed-only`` seeds torch alone (``torch.manual_seed(0)``, as the README's quick start and most scripts do)
instead of every stream (``dr.seed_rng``): Python's ``random`` and NumPy's global stream start from the OS's entropy,
differ between runs, and nothing the script trains draws from them. ``--save-args`` saves the script's arguments in
each checkpoint's ``extra`` (as nanoGPT's ``config`` and torchvision's ``args``), its checkpoint folder among them.
``--snapshot-every N`` also snapshots the state into the node's shared memory every N steps
(``CheckpointManager.snapshot``): a run killed between saves resumes from its newest snapshot.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

import dist_resume as dr

p = argparse.ArgumentParser()
p.add_argument("ckpt", type=Path)
p.add_argument(
    "--bug",
    action="append",
    default=[],
    choices=["scheduler", "rng", "sampler", "generator", "held-batch", "eval-rank0", "prefetch", "fail"],
)
p.add_argument("--steps", type=int, default=32)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--step-seconds", type=float, default=0.025)
p.add_argument("--torch-seed-only", action="store_true")
p.add_argument("--save-args", action="store_true")
p.add_argument("--snapshot-every", type=int, default=0)
args = p.parse_args()
if "fail" in args.bug:
    raise SystemExit("train.py: the data folder 'no-such-data' does not exist")

info = dr.init_distributed()
device = dr.rank_device()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 2))
model: torch.nn.Module = net.to(device)
if not args.torch_seed_only:
    dr.seed_rng(0, device=device)
if info.is_distributed:
    model = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + 0.1 * s))  # restarted, it starts over
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g))
sampler = dr.ResumableDistributedSampler(data, seed=0)
loader_generator = None if {"generator", "prefetch"} & set(args.bug) else torch.Generator().manual_seed(0)


class GroupedBatches:
    """Batches of 8 of the sampler's indices, as torchvision's GroupedBatchSampler makes them (here one group)."""

    def __init__(self, sampler: dr.ResumableDistributedSampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        batch = []
        for index in self.sampler:
            batch.append(index)
            if len(batch) == 8:
                yield batch
                batch = []

    def __len__(self) -> int:
        return len(self.sampler) // 8


if "prefetch" in args.bug:
    loader = DataLoader(data, batch_sampler=GroupedBatches(sampler), num_workers=2)
else:
    loader = DataLoader(data, batch_size=8, sampler=sampler, generator=loader_generator)

position = {} if "sampler" in args.bug else {"sampler": sampler} if "generator" in args.bug else {"dataloader": loader}
mgr = dr.CheckpointManager(
    args.ckpt,
    model=model,
    optimizer=opt,
    scheduler=None if "scheduler" in args.bug else sched,
    keep_last=4,
    **position,
)
res = mgr.resume(options=dr.ResumeOptions(rng="rng" not in args.bug))
step = res.step or 0 if res is not None else 0
saved_args = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
extra = {"args": saved_args, "log_file": str(args.ckpt / "train.log")} if args.save_args else None


def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
    loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    time.sleep(args.step_seconds)


def save(step: int) -> None:
    mgr.save(step, epoch=sampler.epoch, extra=extra)
    if "eval-rank0" in args.bug and info.rank == 0:  # an evaluation on rank 0 only, on a random subset
        with torch.no_grad():
            subset = torch.randint(0, len(data), (16,))
            net(data.tensors[0][subset].to(device))


def batches():  # the loader's batches, epoch after epoch
    while True:
        yield from loader


if "held-batch" in args.bug:
    stream = batches()
    batch = next(stream)
    while step < args.steps:
        train_step(*batch)
        step += 1
        batch = next(stream)  # the next step's batch, drawn ahead of the save
        if step % args.save_every == 0:
            save(step)
else:
    while step < args.steps:
        for x, y in loader:
            train_step(x, y)
            step += 1
            if step % args.save_every == 0:
                save(step)
            elif args.snapshot_every and step % args.snapshot_every == 0:
                mgr.snapshot(step, epoch=sampler.epoch, extra=extra)
            if step == args.steps:
                break
mgr.close()
dr.destroy_distributed()
