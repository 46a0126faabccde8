"""Per-rank body for tests/dist/test_one_rank_faults.py: a fault on rank 1 alone, at each point of a resume where one
rank can fail (its optimizer's or scheduler's load, the copy into the live tensors at the commit, unpacking a
broadcast bucket), through DDP and FSDP2 and each source; every rank must end with the same typed error, promptly.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import dist_resume as dr
from dist_resume._core.shards import local_of
from dist_resume._dist import broadcast
from tests.dist.ddp_workers import flat_state, make, train
from tests.dist.fsdp_resume_workers import _fsdp, _mesh_of, _train
from tests.dist.fsdp_workers import _differ, _locals


@contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


def _copy_into_fails(storages: set[int]) -> Any:
    """``Tensor.copy_`` raising when it writes into one of ``storages`` (a live tensor, written only at the commit)."""
    real = torch.Tensor.copy_

    def copy_(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.untyped_storage().data_ptr() in storages:
            raise RuntimeError("injected: copy into a live tensor failed on rank 1")
        return real(self, *args, **kwargs)

    return _patched(torch.Tensor, "copy_", copy_)


def _unpack_fails(stream: int) -> Any:
    """The ``stream``-th broadcast stream of a resume (1: the small states', 2: the tensors') fails while this rank
    unpacks its first bucket."""
    real_send, real_copy = broadcast._send_tensors, torch.Tensor.copy_
    calls, armed = [0], [False]

    def copy_(self: torch.Tensor, src: Any, *args: Any, **kwargs: Any) -> Any:
        if armed[0] and self.dtype == torch.uint8 and getattr(src, "dtype", None) == torch.uint8:
            raise RuntimeError("injected: unpacking a bucket failed on rank 1")
        return real_copy(self, src, *args, **kwargs)

    def send(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        armed[0] = calls[0] == stream
        try:
            with _patched(torch.Tensor, "copy_", copy_):
                return real_send(*args, **kwargs)
        finally:
            armed[0] = False

    return _patched(broadcast, "_send_tensors", send)


def _failing_load(obj: Any) -> Any:
    """``obj.load_state_dict`` failing once, after it loaded (patched on the class: a scheduler's state dict is its
    ``__dict__``, where an instance attribute would show)."""
    cls = type(obj)
    real = cls.load_state_dict
    calls = [0]

    def load(self: Any, state: Any) -> None:
        real(self, state)
        if self is obj and not calls[0]:
            calls[0] += 1
            raise RuntimeError(f"injected: {cls.__name__}.load_state_dict failed on rank 1")

    return _patched(cls, "load_state_dict", load)


def _outcome(rank: int, fault: Any, resume: Callable[[], Any], state: Callable[[], Any]) -> dict[str, Any]:
    before = state()
    start = time.monotonic()
    try:
        with fault if rank == 1 else nullcontext():
            resume()
        out: dict[str, Any] = {"error": None}
    except dr.DistResumeError as err:
        out = {"error": type(err).__name__, "rank": err.rank, "part": getattr(err, "part", None), "message": str(err)}
    except Exception as err:  # a raw error: the defect the test exists for
        out = {"error": f"raw {type(err).__name__}: {err}"}
    out["elapsed"] = time.monotonic() - start
    out["unchanged"] = state() == before
    dist.barrier()
    return out


def _ddp_cases(rank: int, root: Path) -> dict[str, Any]:
    model, opt, sched = make(seed=3)
    train(model, opt, sched, steps=2, seed=4)
    folder = root / "ddp"
    with dr.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched) as mgr:
        mgr.save(2)
    if rank == 0:  # a node-local copy of ckpt 2 for rank 1
        shutil.copy(folder / "ckpt_00000002.pt", root / "copy.pt")
    dist.barrier()
    model, opt, sched = make(seed=30 + rank)
    train(model, opt, sched, steps=1, seed=5 + rank)

    def state() -> Any:
        flat = flat_state(model, opt)
        return [(k, v.clone()) for k, v in sorted(flat.items())], sched.state_dict()

    def same() -> Any:
        now, sched_now = state()
        return [k for k, v in now], [bool(torch.equal(v, w)) for (_, v), (_, w) in zip(now, first[0])], sched_now

    first = state()
    live = {p.untyped_storage().data_ptr() for p in model.parameters()}
    broadcast_options = dr.ResumeOptions(broadcast_from_rank0=True)

    def resume(options: dr.ResumeOptions | None = None) -> Callable[[], Any]:
        def run() -> Any:
            with dr.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched, options=options) as m:
                return m.resume()

        return run

    out: dict[str, Any] = {
        "ddp_folder_commit": _outcome(rank, _copy_into_fails(live), resume(), same),
        "ddp_broadcast_early": _outcome(rank, _unpack_fails(1), resume(broadcast_options), same),
        "ddp_broadcast_commit": _outcome(rank, _unpack_fails(2), resume(broadcast_options), same),
        "ddp_folder_optimizer": _outcome(rank, _failing_load(opt), resume(), same),
        "ddp_file_optimizer": _outcome(  # a file by path, as hand-written torchrun scripts resume: collective too
            rank, _failing_load(opt), lambda: dr.resume(folder / "ckpt_00000002.pt", model=model, optimizer=opt), same
        ),
    }
    mixed = folder if rank == 0 else folder / "ckpt_00000002.pt"  # rank 0 a folder, rank 1 a file: refused
    out["ddp_mixed_kinds"] = _outcome(rank, nullcontext(), lambda: dr.resume(mixed, model=model), same)
    copy = folder / "ckpt_00000002.pt" if rank == 0 else root / "copy.pt"  # a copy of the same file: fine
    out["ddp_file_copies"] = _outcome(rank, nullcontext(), lambda: dr.resume(copy, model=model), same)
    resume()()  # and then the same objects resume whole
    out["ddp_resumed"] = flat_state(model, opt)["model.fc.weight"].sum().item()
    return out


def _fsdp_cases(rank: int, root: Path) -> dict[str, Any]:
    mesh = _mesh_of(dist.get_world_size())
    model, opt, sched = _fsdp(mesh, seed=0)
    _train(model, opt, sched, 0, 2)
    file = root / "fsdp.pt"
    dr.save_checkpoint(file, model=model, optimizer=opt, scheduler=sched, step=2, full_state=True)
    folder = root / "fsdp"
    with dr.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched) as mgr:
        mgr.save(2)  # a sharded checkpoint folder
    model, opt, sched = _fsdp(mesh, seed=1)
    _train(model, opt, sched, 0, 1)

    def state() -> Any:
        return _locals(model, opt), sched.state_dict()

    first = state()

    def same() -> Any:
        now, sched_now = state()
        return _differ(now, first[0]), sched_now

    def from_file() -> Any:
        return dr.resume(file, model=model, optimizer=opt, scheduler=sched)

    def from_folder() -> Any:
        with dr.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched) as m:
            return m.resume()

    shards = {local_of(p).untyped_storage().data_ptr() for p in model.parameters()}
    out = {
        "fsdp_file_optimizer": _outcome(rank, _failing_load(opt), from_file, same),
        "fsdp_file_scheduler": _outcome(rank, _failing_load(sched), from_file, same),
        "fsdp_folder_scheduler": _outcome(rank, _failing_load(sched), from_folder, same),
        "fsdp_file_commit": _outcome(rank, _copy_into_fails(shards), from_file, same),
    }
    hooked, hooked_opt, hooked_sched = _fsdp(mesh, seed=1)
    hooked.get_submodule("b").register_load_state_dict_pre_hook(lambda *args: None)
    before = _locals(hooked, hooked_opt)
    try:
        dr.resume(file, model=hooked, optimizer=hooked_opt, scheduler=hooked_sched)
        out["fsdp_hook"] = {"error": None}
    except dr.DistResumeError as err:
        out["fsdp_hook"] = {"error": type(err).__name__, "message": str(err)}
    out["fsdp_hook"]["unchanged"] = _differ(_locals(hooked, hooked_opt), before)
    return out


def faults_on_rank1(rank: int, world_size: int, root: str) -> dict[str, Any]:
    base = Path(root)
    return {**_ddp_cases(rank, base), **_fsdp_cases(rank, base)}
