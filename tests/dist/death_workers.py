"""Rank bodies for tests/dist/test_rank_death.py: one rank SIGKILLs itself mid-collective, the others report.

The victim dies from a hook at a precise point (its N-th bucket, right before the consensus gather,
inside torch.save). A survivor writes its report to ``<base>/rank<r>.json``: the harness raises
RankFailure for the dead rank, so the survivors' return values do not come back.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import dist_resume as dr
from dist_resume._dist import broadcast
from dist_resume._source import consensus
from dist_resume._source import read as sources

BUCKET_BYTES = 2048


def make(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model and an AdamW with state: about 24 KiB of tensors, a dozen buckets of BUCKET_BYTES."""
    torch.manual_seed(seed)
    model = nn.Linear(32, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 32)).sum().backward()
    opt.step()
    return model, opt


LINGER = 0.5  # seconds the victim lives on at the point it dies in, so that the others reach their step


def _die() -> None:
    """SIGKILL this process after LINGER seconds. Without the pause a survivor may still be finishing the
    collective before (the dead rank's socket can drop data it had not read yet) and fail there."""
    time.sleep(LINGER)
    os.kill(os.getpid(), signal.SIGKILL)


def _report(base: str, rank: int, fn: Callable[[], Any], check: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` (expected to raise), time it, then run ``check`` (local look at the files); write the report."""
    start = time.monotonic()
    try:
        fn()
        report: dict[str, Any] = {"error": None}
    except dr.DistResumeError as err:
        report = {"error": type(err).__name__, "message": str(err), "ranks": getattr(err, "ranks", None)}
    except Exception as err:  # an escape: the test shows it
        report = {"error": f"escaped {type(err).__name__}", "message": traceback.format_exc()}
    report["elapsed"] = time.monotonic() - start
    report.update(check())
    Path(base, f"rank{rank}.json").write_text(json.dumps(report))
    return report


def _small_buckets() -> None:
    """Every rank: stream the broadcast checkpoint in buckets of BUCKET_BYTES."""
    original = sources.receive_structure  # type: ignore[attr-defined]  # the name _source.read imported

    def small(load: Any, **kwargs: Any) -> Any:
        return original(load, **{**kwargs, "bucket_bytes": BUCKET_BYTES})

    sources.receive_structure = small  # type: ignore[assignment,attr-defined]


def _die_at_bucket(n: int) -> None:
    """This rank dies instead of taking part in the ``n``-th bucket of the checkpoint data (counted over the streams:
    the small states' first, then the tensors written into the live ones)."""
    send = broadcast._send_tensors
    real = dist.broadcast

    def counting(*args: Any, **kwargs: Any) -> Any:
        counting.calls += 1  # type: ignore[attr-defined]
        if counting.calls == n:  # type: ignore[attr-defined]
            _die()
        return real(*args, **kwargs)

    counting.calls = 0  # type: ignore[attr-defined]  # counted over every stream (the small states', then the rest)

    def streaming(*args: Any, **kwargs: Any) -> Any:
        dist.broadcast = counting
        try:
            return send(*args, **kwargs)
        finally:
            dist.broadcast = real

    broadcast._send_tensors = streaming  # type: ignore[assignment]


def _loads(path: Path) -> dict[str, Any]:
    """Local: does ``path`` still load, and at which step."""
    try:
        return {"loads": True, "step": dr.load_checkpoint(path)["meta"]["step"]}
    except dr.DistResumeError as err:
        return {"loads": False, "load_error": str(err)}


def broadcast_rank_dies(rank: int, world_size: int, base: str, ckpt: str, victim: int, bucket: int) -> None:
    """resume(broadcast_from_rank0=True) in small buckets; ``victim`` dies at its ``bucket``-th one."""
    _small_buckets()
    if rank == victim:
        _die_at_bucket(bucket)
    model, opt = make(seed=rank + 10)
    _report(
        base,
        rank,
        lambda: dr.resume(ckpt, model=model, optimizer=opt, options=dr.ResumeOptions(broadcast_from_rank0=True)),
        lambda: _loads(Path(ckpt)),
    )


def consensus_rank_dies(rank: int, world_size: int, base: str, folder: str, victim: int) -> None:
    """resume(folder): ``victim`` dies right before the gather in which the ranks compare what they see (the
    second of the consensus: the first agrees on the kind of source)."""
    if rank == victim:
        gather = consensus.all_gather_objects  # type: ignore[attr-defined]
        calls = iter(range(2))

        def gather_then_die(obj: object) -> object:
            if next(calls) > 0:
                _die()
            return gather(obj)

        consensus.all_gather_objects = gather_then_die  # type: ignore[assignment,attr-defined]
    model, opt = make(seed=rank + 10)
    _report(
        base,
        rank,
        lambda: dr.resume(folder, model=model, optimizer=opt),
        lambda: {"latest": str(dr.tools.latest_checkpoint(folder)), **_loads(Path(folder) / "ckpt_00000002.pt")},
    )


_TORCH_SAVE = torch.save


def _torn_write(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
    """torch.save that writes half a checkpoint file, then the process dies (pickling a storage into
    memory calls torch.save with a BytesIO: that one works)."""
    if isinstance(f, io.BytesIO):
        return _TORCH_SAVE(obj, f, *args, **kwargs)
    f.write(b"PK\x03\x04" + b"\0" * 4096)
    f.flush()
    _die()


def save_writer_dies(rank: int, world_size: int, base: str, folder: str, how: str) -> None:
    """Two saves into a CheckpointManager folder; rank 0 dies inside torch.save of the second.

    ``how`` is "save" (CheckpointManager.save) or "async" (save_async, then wait()).
    """
    model, opt = make(seed=3)
    manager = dr.CheckpointManager(folder, keep_last=2)
    manager.save(1, model=model, optimizer=opt)
    dist.barrier()
    if rank == 0:
        torch.save = _torn_write  # type: ignore[assignment]

    def second() -> None:
        if how == "async":
            manager.save_async(2, model=model, optimizer=opt).wait()
        else:
            manager.save(2, model=model, optimizer=opt)

    def check() -> dict[str, Any]:
        names = sorted(os.listdir(folder))
        return {
            "latest": str(dr.tools.latest_checkpoint(folder)),
            "names": names,
            **_loads(Path(folder) / "ckpt_00000001.pt"),
        }

    _report(base, rank, second, check)
