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
    fail        raises before training (a script that fails on its own)

``--torch-seed-only`` seeds torch alone (``torch.manual_seed(0)``, as the README's quick start and most scripts do)
instead of every stream (``dr.seed_rng``): Python's ``random`` and NumPy's global stream start from the OS's entropy,
differ between runs, and nothing the script trains draws from them.
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
p.add_argument("--bug", action="append", default=[], choices=["scheduler", "rng", "sampler", "generator", "fail"])
p.add_argument("--steps", type=int, default=32)
p.add_argument("--save-every", type=int, default=4)
p.add_argument("--step-seconds", type=float, default=0.025)
p.add_argument("--torch-seed-only", action="store_true")
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
loader_generator = None if "generator" in args.bug else torch.Generator().manual_seed(0)
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
while step < args.steps:
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        time.sleep(args.step_seconds)
        step += 1
        if step % args.save_every == 0:
            mgr.save(step, epoch=sampler.epoch)
        if step == args.steps:
            break
mgr.close()
dr.destroy_distributed()
