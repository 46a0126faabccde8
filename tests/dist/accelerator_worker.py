"""torchrun worker for tests/dist/test_ddp_accelerator.py: DDP on <device>:LOCAL_RANK, several scenarios per launch.

    torchrun ... accelerator_worker.py OUT DEVICE_TYPE SCENARIO[,SCENARIO...]

``DEVICE_TYPE`` is ``sim`` (the test accelerator: ``boot()`` first, launched with ``worker_env()``) or ``cuda``;
``init_distributed()`` then sets ``<type>:LOCAL_RANK`` and picks the backend by device type (simgloo, nccl). The
launching test has written ``OUT/single.pt``, a one-process checkpoint saved on its device 0, and the same state
tagged ``cuda:3`` in ``OUT/single_cuda3.pt`` (as written on a GPU of another machine). After each scenario
every rank rewrites ``OUT/attempt<A>_rank<R>.json`` (scenario -> findings) and saves the state it checks as CPU
tensors to ``OUT/<scenario>_attempt<A>_rank<R>.pt``; the test compares those with its own expectations.

Scenarios:
    single_to_ddp, single_to_ddp_broadcast   resume single.pt / single_cuda3.pt into DDP (broadcast_from_rank0 off /
                                             on: rank 0 reads, the others receive), train 2 steps
    ddp_save                                 train a DDP model 3 steps, save OUT/ddp.pt (the test resumes it alone)
    elastic                                  an uninterrupted run of STEPS steps; then the same run saving at SAVE_AT,
                                             and the last rank SIGKILLs itself after KILL_AT; on the restarted
                                             attempt every rank resumes that checkpoint and finishes the run
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from dist_resume._core.tree import named_tensors
from tests.dist.ddp_workers import flat_state, make, train

STEPS, SAVE_AT, KILL_AT = 6, 3, 4
SAMPLES, BATCH = 64, 4  # 8 steps per epoch on 2 ranks, 4 on 4: STEPS stay in epoch 0 on 2 ranks


class Ctx:
    """What every scenario needs: the rank, its device, the output folder and the report so far."""

    def __init__(self, out: Path, info: dr.RankInfo, device: torch.device, attempt: int) -> None:
        self.out, self.info, self.device, self.attempt = out, info, device, attempt
        self.report: dict[str, Any] = {
            "rank": info.rank,
            "local_rank": info.local_rank,
            "node_rank": info.node_rank,
            "world_size": info.world_size,
            "device": str(device),
            "current_device": str(torch.device(device.type, torch.accelerator.current_device_index())),
            "backend": dist.get_backend(),
            "attempt": attempt,
        }

    def save(self, scenario: str, state: dict[str, torch.Tensor]) -> None:
        torch.save(state, self.out / f"{scenario}_attempt{self.attempt}_rank{self.info.rank}.pt")

    def write(self) -> None:
        path = self.out / f"attempt{self.attempt}_rank{self.info.rank}.json"
        path.write_text(json.dumps(self.report))


def _ddp(model: nn.Module, device: torch.device) -> DDP:
    return DDP(model.to(device), device_ids=[device.index])


def _devices(ddp: nn.Module, opt: torch.optim.Optimizer) -> dict[str, list[str]]:
    """The devices of the model's state and of the optimizer's state, ``step`` apart."""
    opt_state = [(k, v) for s in opt.state.values() for k, v in s.items()]
    return {
        "model": sorted({str(t.device) for t in dr.unwrap_model(ddp).state_dict().values()}),
        "optimizer": sorted({str(v.device) for k, v in opt_state if k != "step"}),
        "step": sorted({str(v.device) for k, v in opt_state if k == "step"}),
    }


def _same_on_every_rank(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return all(torch.equal(gathered[0], g) for g in gathered)


def _resume_single(ctx: Ctx, file: str, broadcast: bool) -> dict[str, Any]:
    model, _, _ = make(seed=100 + ctx.info.rank)  # a different init on every rank
    ddp = _ddp(model, ctx.device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    result = dr.resume(
        ctx.out / file,
        model=ddp,
        optimizer=opt,
        scheduler=sched,
        options=dr.ResumeOptions(broadcast_from_rank0=broadcast),
    )
    dr.check_devices(ddp, opt)
    found: dict[str, Any] = {"step": result.step, "restored": list(result.restored), "devices": _devices(ddp, opt)}
    ctx.save("single_to_ddp_broadcast" if broadcast else "single_to_ddp", flat_state(ddp, opt))
    found["lr"] = opt.param_groups[0]["lr"]
    found["losses"] = train(ddp, opt, sched, steps=2, seed=1000 + ctx.info.rank, device=ctx.device)
    found["same_on_every_rank"] = _same_on_every_rank(ddp)
    return found


def single_to_ddp(ctx: Ctx) -> dict[str, Any]:
    """single.pt (tagged <type>:0) read by every rank; and where load_checkpoint puts it and its cuda:3 copy."""
    found = _resume_single(ctx, "single.pt", broadcast=False)
    found["loaded_devices"] = {
        name: sorted({str(t.device) for _, t in named_tensors(dr.load_checkpoint(ctx.out / name))})
        for name in ("single.pt", "single_cuda3.pt")
    }
    return found


def single_to_ddp_broadcast(ctx: Ctx) -> dict[str, Any]:
    """The cuda:3-tagged copy, read by rank 0 alone and broadcast."""
    return _resume_single(ctx, "single_cuda3.pt", broadcast=True)


def ddp_save(ctx: Ctx) -> dict[str, Any]:
    model, _, _ = make(seed=0)
    ddp = _ddp(model, ctx.device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    train(ddp, opt, sched, steps=3, seed=50 + ctx.info.rank, device=ctx.device)
    path = dr.save_checkpoint(ctx.out / "ddp.pt", model=ddp, optimizer=opt, scheduler=sched, step=3, epoch=0)
    ctx.save("ddp_save", flat_state(ddp, opt))
    return {"exists": path.stat().st_size > 0, "devices": _devices(ddp, opt)}  # every rank returns after the write


# ---------------------------------------------------------------- exact resume and the elastic restart


def _exact_run(ctx: Ctx, seed: int) -> tuple[DDP, torch.optim.Optimizer, dr.ResumableDistributedSampler]:
    """A fresh job's objects: the same weights on every rank, then each rank's own dropout stream."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    ddp = _ddp(model, ctx.device)
    dr.seed_rng(seed, rank=ctx.info.rank, device=ctx.device)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    return ddp, opt, dr.ResumableDistributedSampler(SAMPLES, seed=3)


def _steps(
    ctx: Ctx, ddp: DDP, opt: torch.optim.Optimizer, sampler: Any, first: int, last: int, after: Callable[[int], None]
) -> list[float]:
    """Steps ``first``..``last`` on the sampler's batches (it resumes mid-epoch by itself); ``after(step)``."""
    gen = torch.Generator().manual_seed(5)
    xs, ys = torch.randn(SAMPLES, 6, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen)
    it, losses = iter(sampler), []
    for step in range(first, last + 1):
        idx = torch.tensor([next(it) for _ in range(BATCH)])
        logits, y = ddp(xs[idx].to(ctx.device)), ys[idx].to(ctx.device)
        # cross-entropy written out, as in launch/train.py: nll_loss has no deterministic CUDA kernel
        loss = -(nn.functional.one_hot(y, 3) * logits.log_softmax(-1)).sum(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        after(step)
    return losses


def elastic(ctx: Ctx) -> dict[str, Any]:
    ckpt = ctx.out / "elastic.pt"
    if ctx.attempt == 0:
        ddp, opt, sampler = _exact_run(ctx, seed=1)
        losses = _steps(ctx, ddp, opt, sampler, 1, STEPS, lambda step: None)
        ctx.save("uninterrupted", flat_state(ddp, opt))
        ctx.report["uninterrupted_losses"] = losses
        ctx.write()
        del ddp, opt, sampler
        ddp, opt, sampler = _exact_run(ctx, seed=1)

        def save_then_die(step: int) -> None:
            if step == SAVE_AT:
                dr.save_checkpoint(ckpt, model=ddp, optimizer=opt, dataloader=sampler, step=step)  # rng=True
            if step == KILL_AT and ctx.info.rank == ctx.info.world_size - 1:
                ctx.report["killed_after"] = step
                ctx.write()
                os.kill(os.getpid(), signal.SIGKILL)  # torchrun restarts the group (--max-restarts)

        _steps(ctx, ddp, opt, sampler, 1, STEPS, save_then_die)
        raise AssertionError("the run went past the killed rank's step")  # a collective must have failed first
    ddp, opt, sampler = _exact_run(ctx, seed=99)  # a restarted job: other weights and streams until resumed
    result = dr.resume(ckpt, model=ddp, optimizer=opt, dataloader=sampler)  # rng=True is the default
    dr.check_devices(ddp, opt)
    found: dict[str, Any] = {"step": result.step, "restored": list(result.restored), "devices": _devices(ddp, opt)}
    assert result.step is not None
    found["losses"] = _steps(ctx, ddp, opt, sampler, result.step + 1, STEPS, lambda step: None)
    ctx.save("resumed", flat_state(ddp, opt))
    return found


SCENARIOS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    f.__name__: f for f in (single_to_ddp, single_to_ddp_broadcast, ddp_save, elastic)
}


def main() -> None:
    out, device_type, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # bitwise reruns on GPUs too (before CUDA starts)
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device_type == "sim":
        from tests.accelerator.worker_boot import boot

        boot()  # before any tensor or backward pass
    info = dr.init_distributed(timeout=timedelta(seconds=60))
    device = dr.rank_device()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ctx = Ctx(out, info, device, attempt)
    others = [i for i in range(torch.accelerator.device_count()) if i != device.index]
    for i in others:
        torch.accelerator.reset_peak_memory_stats(i)
    if attempt > 0:  # a restarted group only finishes the interrupted run
        names = [name for name in names if name == "elastic"]
    for name in names:
        ctx.report[name] = SCENARIOS[name](ctx)
        gc.collect()
        # in this process, nothing ever landed on another rank's device: not loading, not broadcasting, not saving
        ctx.report[name]["peak_on_other_devices"] = sum(torch.accelerator.max_memory_allocated(i) for i in others)
        ctx.write()
    dist.barrier()  # nobody tears down its connections while a peer is still talking
    gc.collect()  # DDP models freed before the group goes (a gloo group destroyed from DDP's destructor can hang)
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
