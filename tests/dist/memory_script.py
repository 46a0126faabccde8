"""A DDP (or ``--fsdp``: FSDP2) script as users write it that snapshots every step into host memory and saves every
5 steps (tests/dist/test_memory_tier.py and test_memory_fsdp.py run it under torchrun with 2 ranks, kill it and
relaunch it).

    torchrun --standalone --nproc_per_node=2 [--max-restarts=1] tests/dist/memory_script.py DIR [--steps N]
        [--kill-rank1-at K] [--all-die-at K] [--close-before-dying] [--dump FILE] [--save-every N]
        [--background-commits] [--fsdp] [--preempt-at K]

An MLP with dropout under DDP, AdamW, StepLR, a ``DataLoader`` without ``generator=`` over a
``ResumableDistributedSampler``, all registered with one ``CheckpointManager``, no logging set up.
``--kill-rank1-at K``: in torchrun's first generation, rank 1 SIGKILLs itself right after ``snapshot(K)``;
``--all-die-at K``: in the generation that reaches step K every rank ends at once after ``snapshot(K)`` (``os._exit``:
the whole job dies, as a node losing power would, nothing reaches the folder). Each rank appends the steps it runs to
``DIR.steps_<rank>`` (``generation step`` lines); ``--dump`` writes rank 0's final model and optimizer state (``--fsdp``: the model ``fully_shard``-ed on a CPU mesh instead of
DDP, each rank its own shards to ``DUMP.<rank>``).
``--background-commits``: in torchrun's first generation every snapshot is committed in a background thread, as a large
state's is (this model's is small enough to be committed before ``snapshot`` returns), and slowly, so that the SIGTERM
which torchrun sends rank 0 after rank 1's kill finds the commit of step K under way.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import dist_resume as dr


def _commit_in_background() -> None:
    """Every snapshot's commit in a background thread, taking 0.3 s (a large state's CRC-32s): a SIGTERM comes
    while one is under way."""

    from dist_resume._manager.snapshots import commit
    from dist_resume._shm.pending import PendingSnapshot

    sealed = PendingSnapshot._seal

    def seal(self: PendingSnapshot, layout: Any) -> int:
        time.sleep(0.3)
        return sealed(self, layout)

    commit.COMMIT_INLINE_BYTES = 0  # type: ignore[misc]
    PendingSnapshot._seal = seal  # type: ignore[method-assign]


def _fully_shard(net: nn.Sequential) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (net[0], net[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _local(value: Any) -> Any:
    """``value`` with every DTensor as a copy of this rank's local shard."""
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value.to_local().clone() if hasattr(value, "to_local") else value


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill-rank1-at", type=int, default=None)
    p.add_argument("--all-die-at", type=int, default=None)
    p.add_argument("--dump", default=None)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--background-commits", action="store_true")
    p.add_argument("--fsdp", action="store_true", help="fully_shard the model (per layer, then whole) on a CPU mesh")
    p.add_argument(
        "--preempt-at",
        type=int,
        default=None,
        help="in torchrun's second generation, after snapshot(K) rank 0 sends torchrun SIGTERM (a preemption notice: "
        "torchrun stops every worker with SIGTERM) and every rank waits for it",
    )
    p.add_argument(
        "--close-before-dying", action="store_true", help="close() (the folder gets step K) before --all-die-at"
    )
    args = p.parse_args()

    dr.init_distributed()
    rank = dist.get_rank()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.background_commits and generation == 0:
        _commit_in_background()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 4))
    model = _fully_shard(net) if args.fsdp else DistributedDataParallel(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 4, gamma=0.5)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g))
    sampler = dr.ResumableDistributedSampler(data, seed=0)
    loader = DataLoader(data, batch_size=4, sampler=sampler)  # 8 steps an epoch at 2 ranks
    mgr = dr.CheckpointManager(args.folder, model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    result = mgr.resume()
    resumed = None if result is None else (result.step, result.source)
    print(f"rank {rank} generation {generation}: resumed {resumed}; memory {os.environ.get('DIST_RESUME_SHM_DIR')}")
    step = result.step if result is not None and result.step is not None else 0
    log = Path(f"{args.folder}.steps_{rank}")
    while step < args.steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            with log.open("a") as f:
                f.write(f"{generation} {step}\n")
            mgr.snapshot(step)  # every step, into host memory
            if step % args.save_every == 0:
                mgr.save(step)  # the folder gets the snapshot's bytes, in the background
            if step == args.kill_rank1_at and rank == 1 and generation == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if step == args.preempt_at and generation == 1:
                dist.barrier()  # every rank's snapshot of K committed (else the ranks write the step before)
                if rank == 0:
                    os.kill(os.getppid(), signal.SIGTERM)
                time.sleep(60)  # torchrun's SIGTERM ends it: the handlers write the newest snapshot into the folder
            if step == args.all_die_at:
                if args.close_before_dying:
                    mgr.close()
                os._exit(1)
            if step == args.steps:
                break
    mgr.close()  # copies the newest snapshot the folder lacks, frees the memory
    if args.dump and args.fsdp:  # each rank its own shards
        torch.save({"model": _local(model.state_dict()), "optimizer": _local(opt.state_dict())}, f"{args.dump}.{rank}")
    elif args.dump and rank == 0:
        torch.save({"model": net.state_dict(), "optimizer": opt.state_dict()}, args.dump)
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
