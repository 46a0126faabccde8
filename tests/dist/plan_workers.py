"""Per-rank bodies for tests/dist/test_plan.py (module level so spawned children can import them)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import dist_resume
from dist_resume._checkpoint import model_fit as _model_fit
from dist_resume._checkpoint import plan as _plan
from dist_resume._checkpoint import restore as _restore
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
