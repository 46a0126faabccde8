"""Per-rank bodies for tests/dist/test_plan.py (module level so spawned children can import them)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import dist_resume
from dist_resume._checkpoint import restore as _restore
from dist_resume._checkpoint.plan import model_fit as _model_fit
from dist_resume._checkpoint.plan import restore_plan as _plan
from tests.dist.ddp_workers import flat_state, make


def count_validations(rank: int, world_size: int, ckpt: str) -> dict[str, Any]:
    """Resume with broadcast_from_rank0 while counting every validation step this rank runs."""
    calls: Counter[str] = Counter()
    for name in ("plan_restore", "adapt_state_dict", "prepare_optimizer_state", "check_scheduler"):
        module = {"plan_restore": _restore, "adapt_state_dict": _model_fit}.get(name, _plan)
        real = getattr(module, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        setattr(module, name, spy)
    model, opt, sched = make(seed=70 + rank)
    path = ckpt if rank == 0 else ckpt + ".not-on-this-rank"
    result = dist_resume.resume(
        path, model=model, optimizer=opt, scheduler=sched, options=dist_resume.ResumeOptions(broadcast_from_rank0=True)
    )
    return {"calls": dict(calls), "restored": result.restored, "state": flat_state(model, opt)}


def apply_fails_on_rank1(rank: int, world_size: int, ckpt: str, folder: str) -> dict[str, Any]:
    """Rank 1's optimizer load breaks (once, after torch replaced its state) in a broadcast resume and in a resume
    of a folder resolved across ranks: every rank must put everything back and raise the same error class."""
    broadcast = dist_resume.ResumeOptions(broadcast_from_rank0=True)
    return {
        "broadcast": _resume_failing_on_rank1(rank, ckpt if rank == 0 else ckpt + ".not-on-this-rank", broadcast),
        "folder": _resume_failing_on_rank1(rank, folder, dist_resume.ResumeOptions()),
    }


def _resume_failing_on_rank1(rank: int, path: str, options: Any) -> dict[str, Any]:
    import random

    import torch

    from tests.dist.ddp_workers import train

    model, opt, sched = make(seed=70 + rank)
    train(model, opt, sched, steps=1, seed=5 + rank)  # live optimizer state: the data would land in it
    random.seed(rank)

    def frozen() -> Any:
        return flat_state(model, opt), sched.state_dict(), torch.get_rng_state(), random.getstate()

    before = frozen()
    if rank == 1:
        real = opt.load_state_dict

        def broken(state_dict: Any) -> None:
            real(state_dict)
            raise RuntimeError("injected on rank 1")

        opt.load_state_dict = broken  # type: ignore[method-assign]
    try:
        dist_resume.resume(path, model=model, optimizer=opt, scheduler=sched, options=options)
        report: dict[str, Any] = {"error": None}
    except dist_resume.DistResumeError as err:
        report = {
            "error": type(err).__name__,
            "part": getattr(err, "part", None),
            "from": err.rank,
            "message": str(err),
        }
    after = frozen()
    report["unchanged"] = [
        before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0]),
        before[1] == after[1],
        torch.equal(before[2], after[2]),
        before[3] == after[3],
    ]
    return report
