"""Per-rank bodies for tests/dist/test_striped_resume.py: a DDP resume of a local file, each rank reading its share."""

from __future__ import annotations

import mmap
import os
import shutil
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume
from dist_resume._checkpoint.striped import every_rank_reads
from dist_resume._format import local_ranges
from dist_resume._format.archive import read_archive
from dist_resume._source import checked


class Big(nn.Module):
    """About 6 MiB with AdamW state: two tensors broadcast in place (1 MiB each), small ones packed, int64 buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(512, 512)
        self.bn = nn.BatchNorm1d(512)
        self.fc2 = nn.Linear(512, 512)
        self.head = nn.Linear(512, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc2(torch.relu(self.bn(self.fc1(x)))))


def rchar() -> int:
    """Bytes this process read through read syscalls so far (``/proc/self/io``)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


class MappedBytes:
    """Counts the bytes of ``path`` this process maps with :mod:`mmap` inside the block (a whole-file map counts the
    file's size): the pages a CRC-32 check of a mapped file touches, which ``rchar`` does not count."""

    def __init__(self, path: str) -> None:
        self.path = os.path.realpath(path)
        self.bytes = 0

    def __enter__(self) -> MappedBytes:
        real = mmap.mmap

        def spy(fileno: int, length: int, *args: Any, **kwargs: Any) -> mmap.mmap:
            if fileno >= 0 and os.path.realpath(f"/proc/self/fd/{fileno}") == self.path:
                self.bytes += length or os.fstat(fileno).st_size
            return real(fileno, length, *args, **kwargs)

        self._patch = mock.patch.object(mmap, "mmap", spy)
        self._patch.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._patch.stop()


def make(seed: int, *, steps: int, data_seed: int) -> tuple[DDP, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    ddp = DDP(Big())
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    gen = torch.Generator().manual_seed(data_seed)
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(16, 512, generator=gen)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return ddp, opt, sched


def differences(saved: dict[str, Any], ddp: DDP, opt: torch.optim.Optimizer, sched: Any) -> list[str]:
    """The entries of the live objects that are not bitwise the file's (``saved``: its plain ``torch.load``)."""
    bad = []
    live = ddp.module.state_dict()
    if live.keys() != saved["model"].keys():
        bad.append("model keys")
    for key, value in saved["model"].items():
        got = live.get(key)
        if got is None or got.dtype != value.dtype or not torch.equal(got, value):
            bad.append(f"model.{key}")
    state = opt.state_dict()["state"]
    if state.keys() != saved["optimizer"]["state"].keys():
        bad.append("optimizer ids")
    for pid, entries in saved["optimizer"]["state"].items():
        for name, value in entries.items():
            got = state.get(pid, {}).get(name)
            if got is None or not torch.equal(torch.as_tensor(got), torch.as_tensor(value)):
                bad.append(f"optimizer.{pid}.{name}")
    if sched.state_dict() != saved["scheduler"]:
        bad.append("scheduler")
    return bad


def resumes(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One launch, every check of a sound file: save from DDP, then resume it striped (a manager, ``resume(path)``, a
    fresh optimizer, a plain torch.save file), and through the forced every-rank path, each bitwise the file's."""
    ddp, opt, sched = make(0, steps=3, data_seed=7)
    manager = dist_resume.CheckpointManager(folder, model=ddp, optimizer=opt, scheduler=sched)
    path = str(manager.save(3))
    manager.close()
    saved = torch.load(path, map_location="cpu", weights_only=True)
    out: dict[str, Any] = {"size": os.path.getsize(path)}
    tensors = [*saved["model"].values(), *(v for s in saved["optimizer"]["state"].values() for v in s.values())]
    out["tensor_bytes"] = sum(t.numel() * t.element_size() for t in tensors)

    ddp, opt, sched = make(100 + rank, steps=1, data_seed=100 + rank)  # holding state of its own, unlike the file's
    manager = dist_resume.CheckpointManager(folder, model=ddp, optimizer=opt, scheduler=sched)
    checked.forget(Path(path))  # as after a restart: this process saved it, and would not check it again
    before = rchar()
    with MappedBytes(path) as mapped:
        result = manager.resume()
    out["manager_read"] = rchar() - before
    out["manager_mapped"] = mapped.bytes
    assert result is not None  # the folder holds the checkpoint saved above
    out["manager"] = (result.step, result.restored, differences(saved, ddp, opt, sched))
    manager.close()

    ddp, _, _ = make(200 + rank, steps=0, data_seed=0)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)  # fresh: no state yet
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    before = rchar()
    result = dist_resume.resume(path, model=ddp, optimizer=opt, scheduler=sched)
    out["fresh_read"] = rchar() - before
    out["fresh"] = (result.step, result.restored, differences(saved, ddp, opt, sched))

    ddp, opt, sched = make(300 + rank, steps=1, data_seed=300 + rank)
    with every_rank_reads():
        result = dist_resume.resume(path, model=ddp, optimizer=opt, scheduler=sched)
    out["every_rank"] = (result.step, result.restored, differences(saved, ddp, opt, sched))

    plain = os.path.join(folder, "plain.pt")
    if rank == 0:  # a plain torch.save of the same state: the same resume, striped
        torch.save({"model": saved["model"], "optimizer": saved["optimizer"], "scheduler": saved["scheduler"]}, plain)
    dist.barrier()
    ddp, opt, sched = make(400 + rank, steps=1, data_seed=400 + rank)
    before = rchar()
    result = dist_resume.resume(plain, model=ddp, optimizer=opt, scheduler=sched)
    out["plain_read"] = rchar() - before
    out["plain_size"] = os.path.getsize(plain)
    out["plain"] = (result.step, result.restored, differences(saved, ddp, opt, sched))
    return out


def _snapshot(ddp: DDP, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t.detach().clone() for t in ddp.module.state_dict().values()] + [
        torch.as_tensor(v).clone() for s in opt.state.values() for v in s.values()
    ]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _flip_in_largest_record(path: str) -> None:
    """Flip a byte in the middle of the file's largest record (a tensor record, past the middle of the file)."""
    record = max(read_archive(Path(path)).records, key=lambda r: r.file_size)
    with open(path, "r+b") as f:
        f.seek(record.data_offset + record.file_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def faults(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """One launch, the failures: a flipped byte in one tensor record under ``verify=True`` (every rank refuses before
    any change; in a manager's folder, the checkpoint before it is resumed), and a read that fails on rank 1 during the exchange (every rank says it holds part of it)."""
    ddp, opt, sched = make(0, steps=2, data_seed=7)
    path = os.path.join(folder, "good.pt")
    dist_resume.save_checkpoint(path, model=ddp, optimizer=opt, scheduler=sched, step=2)
    damaged = os.path.join(folder, "damaged.pt")
    if rank == 0:
        shutil.copyfile(path, damaged)
        _flip_in_largest_record(damaged)
    dist.barrier()
    out: dict[str, Any] = {}
    ddp, opt, sched = make(100 + rank, steps=1, data_seed=100 + rank)
    before = _snapshot(ddp, opt)
    try:
        dist_resume.resume(damaged, model=ddp, optimizer=opt, options=dist_resume.ResumeOptions(verify=True))
        out["verify"] = None
    except dist_resume.errors.DistResumeError as err:
        out["verify"] = type(err).__name__
        out["verify_message"] = str(err)
    out["verify_unchanged"] = _same(before, _snapshot(ddp, opt))

    # a manager's folder whose newest checkpoint is that damaged file: rank 0 chooses it by its structure (no rank
    # reads the whole file), the ranks find the damage in their shares under verify=True, and take the one before it
    run = Path(folder) / "run"
    newest = run / "ckpt_00000003.pt"
    run.mkdir(exist_ok=True)
    dist_resume.save_checkpoint(newest, model=ddp, optimizer=opt, scheduler=sched, step=3)
    if rank == 0:
        shutil.copyfile(path, run / "ckpt_00000002.pt")
        _flip_in_largest_record(str(newest))
    dist.barrier()
    manager = dist_resume.CheckpointManager(run, model=ddp, optimizer=opt, scheduler=sched)
    result = manager.resume(options=dist_resume.ResumeOptions(verify=True))
    out["manager_fallback"] = None if result is None else result.step
    manager.close()

    real = local_ranges.read_at

    def failing(f: Any, start: int, buffer: memoryview) -> int:
        if len(buffer) >= 1 << 20:  # a large tensor read in place at the commit, not the small states
            raise OSError(5, "Input/output error (injected)")
        return real(f, start, buffer)

    if rank == 1:
        vars(local_ranges)["read_at"] = failing
    try:
        dist_resume.resume(path, model=ddp, optimizer=opt, scheduler=sched)
        out["commit"] = None
    except dist_resume.errors.DistResumeError as err:
        out["commit"] = type(err).__name__
        out["commit_message"] = str(err)
    finally:
        vars(local_ranges)["read_at"] = real
    return out


def torchrun_main(path: str) -> None:
    """A user's script under torchrun: resume the file (saved by the test) and say whether it matches, on each rank."""
    dist_resume.init_distributed()
    saved = torch.load(path, map_location="cpu", weights_only=True)
    ddp, opt, sched = make(10 + dist.get_rank(), steps=1, data_seed=dist.get_rank())
    result = dist_resume.resume(path, model=ddp, optimizer=opt, scheduler=sched)
    print(f"rank {dist.get_rank()} step {result.step} differences {differences(saved, ddp, opt, sched)}", flush=True)
    dist_resume.destroy_distributed()


if __name__ == "__main__":
    torchrun_main(sys.argv[1])
