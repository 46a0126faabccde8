"""The training script scripts/bench_restart.py runs under ``torchrun --max-restarts`` (2 ranks, gloo, CPU).

Written as a user writes one: a DDP model of four square ``Linear`` layers (no bias) with AdamW, ``--size-mib`` in all
(weights, ``exp_avg``, ``exp_avg_sq``), a ``DataLoader`` over a ``ResumableDistributedSampler``, a
``CheckpointManager`` that resumes, snapshots every ``--snapshot-every`` steps (0: never) and saves every
``--save-every`` steps, until step ``--steps``; ``--step-time`` pads each step to that many seconds (the compute a real
job's step would take on an accelerator, waited for, leaving the CPU to the snapshot's background work as a GPU
would). Rank 1 SIGKILLs itself after each step of ``--kill-at``, the i-th
only in the i-th generation (``TORCHELASTIC_RESTART_COUNT``), so each kill happens once however far a restart goes
back. The only additions are the timestamps it appends to ``--times DIR/times_<rank>`` (one line per event: the
generation, the event, ``time.time()``, and the step): ``start`` (before torch is imported), ``resumed`` (with the
step and ``ResumeResult.source``), ``step`` (each step's end, before its snapshot or save), ``killed``, ``end``.

    python -m torch.distributed.run --standalone --nproc_per_node=2 --max-restarts=1 \
        scripts/_bench_restart_worker.py CKPT_DIR --times TIMES_DIR --steps 80 --kill-at 75
"""

from __future__ import annotations

import time

STARTED = time.time()  # the restarted worker's start: before torch is imported

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import dist_resume as dr  # noqa: E402

LAYERS = 4
BATCH = 4


def width(size_mib: float) -> int:
    """The side of each square Linear so that weights + exp_avg + exp_avg_sq come to ``size_mib``."""
    return max(8, round(math.sqrt(size_mib * 2**20 / (3 * 4 * LAYERS))))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt", help="the checkpoint folder: a path or a URL")
    p.add_argument("--times", type=Path, required=True, help="the folder the timestamps go into")
    p.add_argument("--size-mib", type=float, default=256)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--snapshot-every", type=int, default=1)
    p.add_argument("--kill-at", type=int, nargs="*", default=[])
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="seconds each step takes at least: the rest of a real job's step (an accelerator's compute), waited for",
    )
    args = p.parse_args()

    info = dr.init_distributed()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    log = args.times / f"times_{info.rank}"

    def note(event: str, *fields: object) -> None:
        with log.open("a") as f:
            f.write(" ".join(map(str, (generation, event, time.time(), *fields))) + "\n")

    with log.open("a") as f:
        f.write(f"{generation} start {STARTED}\n")

    d = width(args.size_mib)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers += [nn.Linear(d, d, bias=False)] + ([nn.ReLU()] if i < LAYERS - 1 else [])
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = TensorDataset(torch.randn(16 * BATCH, d, generator=torch.Generator().manual_seed(1)))
    sampler = dr.ResumableDistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)

    mgr = dr.CheckpointManager(args.ckpt, model=model, optimizer=opt, dataloader=loader, keep_last=2)
    result = mgr.resume()
    step = result.step or 0 if result is not None else 0
    note("resumed", step, "none" if result is None else result.source)
    while step < args.steps:
        for (x,) in loader:
            began = time.perf_counter()
            loss = model(x).square().mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            time.sleep(max(0.0, args.step_time - (time.perf_counter() - began)))
            step += 1
            note("step", step)
            if args.snapshot_every and step % args.snapshot_every == 0:
                mgr.snapshot(step)
            if step % args.save_every == 0:
                mgr.save(step)
            kills = args.kill_at
            if info.rank == 1 and generation < len(kills) and step == kills[generation]:
                note("killed", step)
                os.kill(os.getpid(), signal.SIGKILL)  # torchrun stops rank 0 (SIGTERM) and restarts both
            if step == args.steps:
                break
    mgr.close()
    note("end", step)
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
