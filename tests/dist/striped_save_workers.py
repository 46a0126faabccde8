"""Per-rank bodies for tests/dist/test_striped_save.py (module level so spawned children can import them)."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume
from dist_resume._format import striped_write
from dist_resume._save import striped, striped_plan

FILE_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
import dist_resume as dr

def written():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])

dr.init_distributed()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(768, 768) for _ in range(4)]))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
start = mgr.resume()
for step in range(1, 4):
    model(torch.randn(8, 768)).sum().backward()
    opt.step()
    opt.zero_grad()
    if step == 3:
        before = written()
        mgr.save(step)
        report = json.dumps({"rank": dist.get_rank(), "written": written() - before}) + chr(10)
        sys.stdout.flush()
        os.write(1, report.encode())  # one write of the whole line: the ranks share torchrun's stdout
mgr.close()
dr.destroy_distributed()
"""


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A DDP model of four 2.25 MiB weights (large records) with a BatchNorm (buffers: rank 0's), AdamW, one step."""
    torch.manual_seed(seed)
    net = nn.Sequential(*[nn.Linear(768, 768) for _ in range(4)], nn.BatchNorm1d(768))
    model = DDP(net)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + dist.get_rank())  # different data per rank, as DDP has
    model(torch.randn(8, 768, generator=gen)).sum().backward()
    opt.step()
    opt.zero_grad()
    model(torch.randn(8, 768, generator=gen))  # each rank's own BatchNorm statistics, after DDP's broadcast
    return model, opt


def written() -> int:
    """The bytes this process has written so far (``wchar`` of /proc/self/io)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _measured(fn: Any) -> int:
    dist.barrier()
    before = written()
    fn()
    return written() - before


def _failing_write_all(real: Any) -> Any:
    calls = [0]

    def write_all(fd: int, data: Any, offset: int) -> None:
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data, offset)

    return write_all


def striped_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One launch, every check: a striped save and a rank-0 save of the same state, a failure on rank 1, an
    asynchronous save, and a folder rank 1 does not see."""
    root = Path(folder)
    model, opt = make()
    out: dict[str, Any] = {"rank": rank}
    handler = _Lines()
    logging.getLogger("dist_resume").addHandler(handler)

    striped_file, rank0_file = root / "striped.pt", root / "rank0.pt"
    out["striped_written"] = _measured(
        lambda: dist_resume.save_checkpoint(striped_file, model=model, optimizer=opt, step=1, rng=False)
    )
    striped_plan.rank0_only = True
    out["rank0_written"] = _measured(
        lambda: dist_resume.save_checkpoint(rank0_file, model=model, optimizer=opt, step=1, rng=False)
    )
    striped_plan.rank0_only = False

    run = root / "run"
    mgr = dist_resume.CheckpointManager(run, model=model, optimizer=opt, keep_last=3)
    mgr.save(1)
    real = striped_write.write_all  # type: ignore[attr-defined]  # the name striped_write imported (patched there)
    if rank == 1:
        striped_write.write_all = _failing_write_all(real)  # type: ignore[attr-defined]
    try:
        mgr.save(2)
        out["failure"] = None
    except dist_resume.CheckpointWriteError as err:
        out["failure"] = (type(err).__name__, str(err), err.rank)
    finally:
        striped_write.write_all = real  # type: ignore[attr-defined]
    dist.barrier()
    out["after_failure"] = sorted(p.name for p in run.iterdir())

    out["async_written"] = _measured(lambda: mgr.save_async(3).wait())
    dist.barrier()
    out["after_async"] = sorted(p.name for p in run.iterdir())
    mgr.close()

    hidden = root / "hidden"
    if rank == 0:
        hidden.mkdir()
    dist.barrier()
    real_sees = striped._sees
    if rank == 1:
        striped._sees = lambda fd, token: False  # type: ignore[assignment]
    handler.lines.clear()
    try:
        out["hidden_written"] = _measured(
            lambda: dist_resume.save_checkpoint(hidden / "a.pt", model=model, optimizer=opt, step=4, rng=False)
        )
        dist_resume.save_checkpoint(hidden / "b.pt", model=model, optimizer=opt, step=5, rng=False)
    finally:
        striped._sees = real_sees  # type: ignore[assignment]
    out["hidden_lines"] = [line for line in handler.lines if "rank 0 alone" in line]
    out["hidden_files"] = sorted(p.name for p in hidden.iterdir())
    logging.getLogger("dist_resume").removeHandler(handler)
    return out
