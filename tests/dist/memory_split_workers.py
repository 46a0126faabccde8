"""Per-rank bodies for tests/dist/test_memory_split.py (module level so spawned children can import them)."""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import dist_resume
from dist_resume._manager.memory import split
from dist_resume._memory import newest_snapshot
from tests.dist.striped_save_workers import make


class _Stop(Exception):
    pass


def _tensor_bytes(path: Path) -> int:
    with zipfile.ZipFile(path) as zf:
        return sum(i.file_size for i in zf.infolist() if i.filename.startswith("archive/data/"))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and optimizer state (the same on every DDP rank), and on rank 0 its buffers (what a resume
    restores on every rank: BatchNorm's statistics are each rank's own before)."""
    moments = [t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    kept = model.state_dict().values() if dist.get_rank() == 0 else model.parameters()
    return [t.detach().clone() for t in [*kept, *moments]]


def split_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Snapshot 1 split across the two ranks, snapshot 2 by the writer alone (the private switch), snapshot 3 split;
    snapshot 4 fails in rank 1's copy; the block ends with an error (the snapshots kept); a fresh model resumes."""
    folder = Path(tmp) / "run"
    model, opt = make()
    out: dict[str, Any] = {"rank": rank}
    try:
        with dist_resume.CheckpointManager(folder, model=model, optimizer=opt) as mgr:
            mgr.snapshot(1)
            out["copied_split"] = mgr._memory.copied
            if rank == 0:
                mgr._memory._join_commit(raising=True)
                assert mgr._memory.newest is not None
                out["tensor_bytes"] = _tensor_bytes(mgr._memory.newest.path)
            split.writer_only = True
            try:
                mgr.snapshot(2)
            finally:
                split.writer_only = False
            out["copied_writer_only"] = mgr._memory.copied
            gen = torch.Generator().manual_seed(7 + rank)
            model(torch.randn(8, 768, generator=gen)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.snapshot(3)
            out["copied_3"] = mgr._memory.copied
            expected = _state(model, opt)

            def fails(*args: Any) -> int:
                raise RuntimeError(f"injected in rank {rank}'s copy")

            with mock.patch.object(split, "copy_records", fails):  # rank 1 alone: the writer's is write.copy_records
                try:
                    mgr.snapshot(4)
                except Exception as err:
                    out["error"] = (type(err).__name__, str(err))
            newest = newest_snapshot(folder, verify=True)
            out["newest_after_failure"] = None if newest is None else newest.step
            dist.barrier()
            raise _Stop  # the snapshots stay, as after a crash
    except _Stop:
        pass
    fresh, fresh_opt = make(seed=1)
    with dist_resume.CheckpointManager(folder, model=fresh, optimizer=fresh_opt) as again:
        result = again.resume()
        out["resumed"] = None if result is None else (result.step, result.source)
        out["bitwise"] = all(torch.equal(a, b) for a, b in zip(_state(fresh, fresh_opt), expected, strict=True))
    return out
