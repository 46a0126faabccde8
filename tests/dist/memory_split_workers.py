"""Per-rank bodies for tests/dist/test_memory_split.py (module level so spawned children can import them)."""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import zipfile
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import dist_resume
from dist_resume._manager.snapshots import split, striped_copy
from dist_resume._save import striped, striped_plan
from dist_resume._shm import newest_snapshot
from tests.dist.striped_save_workers import _Lines, make, written  # the library's INFO lines


class _Stop(Exception):
    pass


def _tensor_bytes(path: Path) -> int:
    with zipfile.ZipFile(path) as zf:
        return sum(i.file_size for i in zf.infolist() if i.filename.startswith("archive/data/"))


def _copied(mgr: dist_resume.CheckpointManager, step: int) -> int:
    """``save(step)`` of a snapshot, its copy into the folder waited for on every rank; the bytes this rank wrote."""
    dist.barrier()
    before = written()
    mgr.save(step)
    mgr._memory._join_copy()  # rank 0: its copy, raising its error; another rank: its share
    return written() - before


def _identical(path: Path, slot: bytes) -> bool:
    """Whether the checkpoint at ``path`` holds the snapshot's bytes, passes testzip and loads."""
    with zipfile.ZipFile(path) as zf:
        whole = zf.testzip() is None
    return whole and path.read_bytes() == slot and "model" in torch.load(path, weights_only=True)


def _no_space(*args: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and optimizer state (the same on every DDP rank), and on rank 0 its buffers (what a resume
    restores on every rank: BatchNorm's statistics are each rank's own before)."""
    moments = [t for s in opt.state_dict()["state"].values() for t in s.values() if isinstance(t, torch.Tensor)]
    kept = model.state_dict().values() if dist.get_rank() == 0 else model.parameters()
    return [t.detach().clone() for t in [*kept, *moments]]


def split_checks(rank: int, world_size: int, tmp: str) -> dict[str, Any]:
    """Snapshot 1 split across the two ranks and copied into the folder striped, snapshot 2 by the writer alone (the
    private switch) and copied by rank 0 alone (``DIST_RESUME_SAVE_RANK0``), snapshot 3 split, its copy failing in rank
    1's share; snapshot 4 fails in rank 1's copy; the block ends with an error (the snapshots kept); a fresh model
    resumes, snapshots step 5 (under the size from which the copy is split: the writer alone) and close() copies it
    striped."""
    folder = Path(tmp) / "run"
    model, opt = make()
    out: dict[str, Any] = {"rank": rank}
    threshold, split.SPLIT_MIN_BYTES = split.SPLIT_MIN_BYTES, 0  # this state is small: split its copy anyway
    saved = _Lines()
    logging.getLogger("dist_resume").addHandler(saved)
    try:
        with dist_resume.CheckpointManager(folder, model=model, optimizer=opt) as mgr:
            mgr.snapshot(1)
            out["copied_split"] = mgr._memory.copied
            if rank == 0:
                mgr._memory._join_commit(raising=True)
                assert mgr._memory.newest is not None
                out["tensor_bytes"] = _tensor_bytes(mgr._memory.newest.path)
            out["persisted_striped"] = _copied(mgr, 1)
            if rank == 0:
                assert mgr._memory.newest is not None and mgr._memory.newest.persisted
                slot = mgr._memory.newest.path.read_bytes()
                out["persist_size"] = len(slot)
                out["persist_identical"] = _identical(folder / "ckpt_00000001.pt", slot)
            split.writer_only = True
            try:
                mgr.snapshot(2)
            finally:
                split.writer_only = False
            out["copied_writer_only"] = mgr._memory.copied
            striped_plan.rank0_only = True  # DIST_RESUME_SAVE_RANK0=1
            try:
                out["persisted_rank0"] = _copied(mgr, 2)
            finally:
                striped_plan.rank0_only = False
            gen = torch.Generator().manual_seed(7 + rank)
            model(torch.randn(8, 768, generator=gen)).sum().backward()
            opt.step()
            opt.zero_grad()
            mgr.snapshot(3)
            out["copied_3"] = mgr._memory.copied
            expected = _state(model, opt)
            with mock.patch.object(striped_copy, "write_all", _no_space) if rank == 1 else contextlib.nullcontext():
                mgr.save(3)  # returns at once; rank 1's share of the copy fails in the background
                mgr._memory._join_copy(raising=False)  # both copies over, the error kept for the next call
            dist.barrier()
            out["after_copy_failure"] = sorted(p.name for p in folder.iterdir())
            if rank == 0:  # the previous checkpoint, untouched
                out["checkpoint_2"] = torch.load(folder / "ckpt_00000002.pt", weights_only=True)["meta"]["step"]
            try:
                mgr.save(3)  # the next call: the copy's error, on every rank
            except Exception as err:
                out["copy_error"] = (type(err).__name__, str(err))

            def fails(*args: Any) -> int:
                raise RuntimeError(f"injected in rank {rank}'s copy")

            with mock.patch.object(split, "copy_records", fails):  # rank 1 alone: the writer's is writer.copy_records
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
        split.SPLIT_MIN_BYTES = threshold  # under it, the writer copies alone: no plan to send
        again.snapshot(5)
        out["copied_small_state"] = again._memory.copied
        if rank == 0:
            again._memory._join_commit(raising=True)
            assert again._memory.newest is not None
            slot = again._memory.newest.path.read_bytes()
        dist.barrier()
        before = written()
    out["closed_striped"] = written() - before  # close() copied snapshot 5 into the folder
    if rank == 0:
        out["close_identical"] = _identical(folder / "ckpt_00000005.pt", slot)
    out.update(_small_folder_checks(rank, Path(tmp) / "small"))
    logging.getLogger("dist_resume").removeHandler(saved)
    out["lines"] = saved.lines
    return out


def _small_folder_checks(rank: int, folder: Path) -> dict[str, Any]:
    """A small state (rank 1 copies all of it: rank 0's range is empty) in another folder: its snapshot damaged in
    memory before the copy, then rank 1 unable to see the folder (rank 0 copies alone)."""
    out: dict[str, Any] = {}
    with dist_resume.CheckpointManager(folder, model=torch.nn.Linear(4, 2)) as mgr:
        mgr.snapshot(1)
        if rank == 0:  # a byte of the committed snapshot changes in memory before its copy
            mgr._memory._join_commit(raising=True)
            assert mgr._memory.newest is not None
            fd = os.open(mgr._memory.newest.path, os.O_RDWR)
            try:
                os.pwrite(fd, bytes([os.pread(fd, 1, 100)[0] ^ 0xFF]), 100)
            finally:
                os.close(fd)
        dist.barrier()
        mgr.save(1)
        mgr._memory._join_copy(raising=False)
        try:
            mgr.snapshot(2)  # the next call: the copy's error, on every rank
        except Exception as err:
            out["damaged_error"] = (type(err).__name__, str(err))
        dist.barrier()
        out["after_damage"] = sorted(p.name for p in folder.iterdir())
        mgr.snapshot(2)
        striped_copy._seen.clear()  # the folder's visibility is checked again at the next copy
        with mock.patch.object(striped, "_sees", lambda fd, token: rank != 1):
            mgr.save(2)
            mgr._memory._join_copy()
        out["unseen_copied"] = sorted(p.name for p in folder.iterdir())
    return out
