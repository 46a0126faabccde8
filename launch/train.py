#!/usr/bin/env python
"""Reference training script: DDP, checkpoints, exact resume — built on the public dist_resume API only.

One process or any number under torchrun, on the accelerator torch reports (``cuda``, ``xpu``, ``npu``, ``hpu``,
``mps``, a PrivateUse1 backend: one device per process, ``<type>:LOCAL_RANK``, its own process-group backend such
as nccl) or on the CPU (gloo)::

    python launch/train.py --ckpt-dir ckpt --steps 100
    torchrun --standalone --nproc_per_node=2 launch/train.py --ckpt-dir ckpt --steps 100

Run it again (or let torchrun restart it) and it continues from the newest checkpoint in
``--ckpt-dir`` (``--resume auto``) with the same sampler position and RNG streams, so an
interrupted run ends bitwise equal to an uninterrupted one at the same world size. A different
world size finishes the interrupted epoch with every sample seen once.

``step`` counts optimizer steps completed: the checkpoint of step 60 holds the state after 60
steps, and a resumed run continues at ``result.step`` (its next step is number 61).

Output: this script's own lines (logger ``train``) and the library's (logger ``dist_resume``,
``--log-level``, default INFO), from rank 0; other ranks print warnings and errors only.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import logging
import os
import signal
import sys
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

# torch warns "Failed to initialize NumPy" on import when numpy is not installed. Neither this script
# nor dist_resume needs numpy (the install stays torch-only), so that one warning is noise here.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)

import torch  # noqa: E402 (after the warning filter)
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

try:
    import dist_resume as dr
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import dist_resume as dr

log = logging.getLogger("train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--ckpt-dir",
        type=Path,
        default=Path("checkpoints"),
        help="checkpoint folder: ckpt_<step>.pt, written atomically, the last --keep-last kept",
    )
    p.add_argument(
        "--resume",
        default="auto",
        help="'auto': newest checkpoint in --ckpt-dir if any; 'none': start fresh; or a file/folder",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="start a new run from this checkpoint's model and optimizer state (any world size; this run's "
        "lr and schedule); ignored once --ckpt-dir holds a checkpoint of this run (needs --resume auto)",
    )
    p.add_argument("--steps", type=int, default=100, help="total optimizer steps")
    p.add_argument("--epochs", type=int, default=None, help="stop after this many epochs (default: --steps decides)")
    p.add_argument("--save-every", type=int, default=20, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep in --ckpt-dir")
    p.add_argument("--batch-size", type=int, default=16, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=512, help="size of the synthetic dataset")
    p.add_argument(
        "--device",
        default="auto",
        help="'auto': this process's accelerator (<type>:LOCAL_RANK) if torch reports one, else the CPU; 'cpu'; or an "
        "accelerator type (cuda, xpu, npu, hpu, mps, ...) that must be the one torch reports",
    )
    p.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import MODULE before any device is used (repeatable): a device's torch plugin that registers its "
        "backend where torch does not load it by itself, e.g. dist_resume.testing.sim.plugin, the simulated devices",
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="autocast: float16 + GradScaler on an accelerator whose autocast torch supports, bfloat16 on the CPU",
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="torch.use_deterministic_algorithms, so reruns are bitwise equal on GPUs too",
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument(
        "--log-level",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        default="INFO",
        help="level of the library's logger, logging.getLogger('dist_resume'): saves, rotations, what resume restored",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds a collective may wait for the other ranks before the process group gives up",
    )
    test = p.add_argument_group("for tests")
    test.add_argument(
        "--dump-losses",
        type=Path,
        default=None,
        help="append one JSON line per step to DIR/rank<R>.jsonl (loss, sample indices, attempt)",
    )
    test.add_argument("--dump-final", type=Path, default=None, help="rank 0 saves final model+optimizer state here")
    test.add_argument("--stop-after", type=int, default=None, help="checkpoint at this step and exit, as if preempted")
    test.add_argument(
        "--kill-at-step",
        type=int,
        default=None,
        help="SIGKILL one rank after this step, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0)",
    )
    test.add_argument("--kill-rank", type=int, default=None, help="the rank to kill (default: the last)")
    args = p.parse_args(argv)
    for name in ("steps", "save_every", "batch_size", "num_samples", "log_every", "keep_last"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.epochs is not None and args.epochs < 1:
        p.error("--epochs must be at least 1")
    if args.init_from is not None and args.resume != "auto":
        p.error("--init-from starts a run whose --ckpt-dir holds no checkpoint yet: use it with --resume auto")
    return args


class SyntheticDataset(Dataset[tuple[int, torch.Tensor, torch.Tensor]]):
    """A fixed, offline classification task (a noisy random linear teacher); items are (index, x, y)."""

    def __init__(self, num_samples: int, features: int = 32, classes: int = 4) -> None:
        g = torch.Generator().manual_seed(1234)  # the data never depends on --seed
        self.x = torch.randn(num_samples, features, generator=g)
        teacher = torch.randn(features, classes, generator=g)
        self.y = (self.x @ teacher + 0.5 * torch.randn(num_samples, classes, generator=g)).argmax(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return i, self.x[i], self.y[i]


def build_model(features: int = 32, classes: int = 4) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, classes))


def pick_device(choice: str) -> torch.device:
    if choice == "cpu":
        return torch.device("cpu")
    device = dr.rank_device()  # <accelerator>:<LOCAL_RANK>, never RANK; cpu without an accelerator
    if choice != "auto" and device.type != choice:
        found = f"this process's accelerator is {device.type}" if device.type != "cpu" else "torch reports none"
        raise SystemExit(f"--device {choice}, but {found}; use --device auto or cpu (or --plugin for its module)")
    return device


def autocast_dtype(device: torch.device) -> torch.dtype:
    """float16 (with a GradScaler) on an accelerator, bfloat16 on the CPU; exit where torch has no autocast for it."""
    dtype = torch.bfloat16 if device.type == "cpu" else torch.float16
    try:  # torch.amp.is_autocast_available() says yes for any PrivateUse1 backend: ask autocast itself
        with torch.autocast(device.type, dtype=dtype):
            pass
    except (AssertionError, RuntimeError) as err:  # what torch raises for a backend without autocast support
        raise SystemExit(
            f"--amp: torch has no {dtype} autocast for {device.type} here ({str(err).strip().splitlines()[0]}); "
            "run without --amp"
        ) from err
    return dtype


def resume_run(
    args: argparse.Namespace, ckpts: dr.CheckpointManager, **objects: Any
) -> tuple[dr.ResumeResult | None, bool]:
    """Resume per --resume: (the result, or None for a fresh start; whether it is --init-from's).

    Collective: call on every rank. ``--resume auto`` is ``CheckpointManager.resume``: rank 0 looks at
    --ckpt-dir, takes its write lock (a second job on it stops here) and every rank follows. It restores
    the newest complete checkpoint of this run into the registered objects, or else --init-from's model
    (and optimizer state, when that file has it: a new run at step 0, with this run's learning rate and
    schedule), or returns None. A folder whose checkpoints are all damaged, or a missing --init-from, raises.
    Model, optimizer, scheduler, scaler, data position and RNG streams are restored (rng=True is the default).
    """
    if args.resume == "none":
        return None, False
    if args.resume != "auto":  # an explicit file or folder must exist
        return dr.resume(args.resume, **objects), False
    res = ckpts.resume(init_from=args.init_from)
    init = args.init_from
    return res, init is not None and res is not None and init in (res.path, res.path.parent)


def setup_logging(rank: int, library_level: str) -> None:
    """Rank 0 prints INFO and above, the other ranks WARNING and above; the library logs at ``library_level``.

    dist_resume logs through ``logging.getLogger("dist_resume")`` and, like any library, configures
    no handler: without a call like this one its INFO lines (saved, rotated, resumed) are not shown.
    """
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.NOTSET if rank == 0 else logging.WARNING)
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    logging.getLogger("dist_resume").setLevel(library_level)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for module in args.plugin:  # before anything asks torch which accelerator this process has
        importlib.import_module(module)
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS reads it when it starts
        torch.use_deterministic_algorithms(True, warn_only=True)  # a warning names any op that is not
    device = pick_device(args.device)
    # the device type's own backend (nccl, xccl, hccl, or what its plugin registered), gloo for CPU training
    info = dr.init_distributed(
        backend="gloo" if device.type == "cpu" else None, timeout=timedelta(seconds=args.timeout)
    )
    setup_logging(info.rank, args.log_level)
    backend = f", process group backend {dist.get_backend()}" if dist.is_initialized() else ""
    log.info("rank %d of %d on %s%s", info.rank, info.world_size, device, backend)
    try:
        train(args, info, device)
    finally:
        # Free what the run left in reference cycles before destroying the group. A DDP model keeps
        # the gloo group alive even so (torch 2.13); exiting is still safe because every collective
        # of this script is dist_resume's, and those return only once gloo has let go of their tensors.
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def train(args: argparse.Namespace, info: dr.RankInfo, device: torch.device) -> None:
    rank, world = info.rank, info.world_size
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model: nn.Module = build_model().to(device)
    dr.seed_rng(args.seed, rank=rank, device=device)  # then each rank its own dropout stream
    if info.is_distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device.index])
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=args.lr, weight_decay=0.01)
    warmup = 10
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    amp_dtype = autocast_dtype(device) if args.amp else None
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

    dataset = SyntheticDataset(args.num_samples)
    sampler = dr.ResumableDistributedSampler(dataset, seed=args.seed)
    # The loader gets its own generator: otherwise each new iterator draws from the global RNG
    # and a resumed run (one extra iterator) would drift from the uninterrupted one.
    loader = DataLoader(
        dataset, batch_size=args.batch_size, sampler=sampler, generator=torch.Generator().manual_seed(args.seed)
    )

    step = 0
    objects = dr.TrainingObjects(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, dataloader=loader
    )
    ckpts = dr.CheckpointManager(args.ckpt_dir, keep_last=args.keep_last, **objects)  # registered once
    res, initialised = resume_run(args, ckpts, **objects)
    if res is not None and initialised:  # model and optimizer state only: this run's lr, schedule, data order
        log.info(
            "initialised from %s (step %s of a %s-rank run); starting a new run at step 0 with %d rank(s)",
            res.path,
            res.metadata.get("step", "?"),
            res.metadata.get("world_size", "?"),
            world,
        )
    elif res is not None:
        step = res.step or 0  # optimizer steps completed: the loop continues with step + 1
        # dist_resume has logged "resumed from <file> at step N (epoch E) in T s (restored ...)"; say where training goes on
        log.info(
            "continuing at step %d, epoch %d, sample %d of %d (saved by %s rank(s), now %d; attempt %d)",
            step,
            sampler.epoch,
            sampler.consumed,
            len(dataset),
            res.metadata.get("world_size", "?"),
            world,
            attempt,
        )
    else:
        log.info("no checkpoint to resume from (--resume %s): starting at step 0 with %d rank(s)", args.resume, world)
    dr.check_devices(model, optimizer)

    losses = None
    if args.dump_losses is not None:
        args.dump_losses.mkdir(parents=True, exist_ok=True)
        losses = open(args.dump_losses / f"rank{rank}.jsonl", "a", buffering=1)
    kill_rank = world - 1 if args.kill_rank is None else args.kill_rank
    last = min(args.steps, args.stop_after or args.steps)
    saved_at = step if res is not None and not initialised else None

    def save() -> None:
        nonlocal saved_at
        extra = {"seed": args.seed, "num_samples": args.num_samples, "batch_size": args.batch_size}
        ckpts.save(step, extra=extra)  # collective: the registered objects, RNG streams too; the loop's epoch
        saved_at = step

    model.train()
    while step < last and (args.epochs is None or sampler.epoch < args.epochs):
        epoch = sampler.epoch
        for idx, x, y in loader:  # the sampler resumes mid-epoch and moves to the next epoch by itself
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            # no autocast object at all without --amp: torch refuses one for a backend it cannot autocast
            with torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext():
                logits = model(x)
            # cross-entropy written out: F.cross_entropy's nll_loss has no deterministic CUDA kernel
            loss = -(F.one_hot(y, logits.shape[-1]) * logits.float().log_softmax(-1)).sum(-1).mean()
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if losses is not None:
                losses.write(
                    json.dumps(
                        {
                            "step": step,
                            "epoch": epoch,
                            "loss": loss.item(),
                            "indices": idx.tolist(),
                            "rank": rank,
                            "local_rank": info.local_rank,
                            "node_rank": info.node_rank,
                            "device": str(device),
                            "attempt": attempt,
                            "world_size": world,
                        }
                    )
                    + "\n"
                )
            if step % args.log_every == 0:
                # the epoch a checkpoint saved now records: the one the loop continues in (the next, after an
                # epoch's last batch), so that this line and the save's "saved ... (step N, epoch E)" agree
                now = sampler.state_dict()["epoch"]
                ended = f" (epoch {epoch} done)" if now != epoch else ""
                lr = scheduler.get_last_lr()[0]
                log.info("step %d  epoch %d%s  loss %.4f  lr %.2e", step, now, ended, loss.item(), lr)
            if step == args.kill_at_step and attempt == 0 and rank == kill_rank:
                log.warning("rank %d: SIGKILL at step %d (--kill-at-step, first attempt only)", rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            if step % args.save_every == 0 or step == last:
                save()
            if step >= last:
                break
    if saved_at != step:
        save()  # --epochs ended the run between checkpoints
    ckpts.close()  # writes a save held at an epoch's last batch (docs/checkpoint-folders.md), releases the lock
    position = sampler.state_dict()  # where the loop continues, as the last checkpoint records it
    if args.stop_after is not None and step == args.stop_after < args.steps:
        log.info(
            "stopping at step %d as if preempted (--stop-after %d): epoch %d, sample %d of %d; "
            "run the same command without --stop-after to resume",
            step,
            args.stop_after,
            position["epoch"],
            position["consumed"],
            len(dataset),
        )
    else:
        log.info(
            "done: step %d, epoch %d, sample %d of %d", step, position["epoch"], position["consumed"], len(dataset)
        )
    if args.dump_final is not None and rank == 0:
        torch.save(
            {
                "model": dr.unwrap_model(model).state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "step": step,
            },
            args.dump_final,
        )
    if losses is not None:
        losses.close()


if __name__ == "__main__":
    sys.exit(main())
