"""Object collectives that need nothing but torch.

torch's ``broadcast_object_list`` / ``all_gather_object`` / ``gather_object`` decode through
``tensor.numpy()`` and fail with "Numpy is not available" on a torch-only install; these pickle into
a uint8 tensor and read it back with ``ctypes``, on the backend's device.
"""

from __future__ import annotations

import ctypes
import pickle
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._core import errors as _errors
from .._core.errors import CheckpointWriteError, DistResumeError
from .env import is_distributed

__all__ = ["comm_device", "broadcast_object", "all_gather_objects", "run_on_rank0"]


def comm_device() -> torch.device:
    """Where collectives of this process group take their tensors: the current GPU for nccl, else cpu."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(buf: torch.Tensor, size: int) -> Any:
    cpu = buf[:size].cpu().contiguous()
    return pickle.loads(ctypes.string_at(cpu.data_ptr(), size))


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Collective: every rank returns ``src``'s ``obj`` (others pass anything, e.g. None)."""
    device = comm_device()
    payload = _encode(obj, device) if dist.get_rank() == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(size, src=src)
    n = int(size.item())
    buf = payload if payload is not None else torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=src)
    return obj if dist.get_rank() == src else _decode(buf, n)


def all_gather_objects(obj: Any) -> list[Any]:
    """Collective: every rank returns the list of all ranks' ``obj``, indexed by rank."""
    device = comm_device()
    payload = _encode(obj, device)
    world = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    dist.all_gather(bufs, padded)
    return [_decode(buf, n) for buf, n in zip(bufs, counts)]


def run_on_rank0(fn: Callable[[], Any], fallback: type[DistResumeError] = CheckpointWriteError) -> Any:
    """Run ``fn`` on global rank 0 only; every rank returns its result or raises its error.

    Collective under torch.distributed (one broadcast), so a failure on rank 0 never leaves the
    other ranks waiting in a barrier: they raise the same dist_resume error class (``fallback``
    for any other exception).
    """
    if not is_distributed():
        return fn()
    outcome: Any = None
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            outcome = ("ok", fn())
        except Exception as err:  # reported to every rank below
            failure = err
            outcome = ("error", type(err).__name__, str(err))
    outcome = broadcast_object(outcome, src=0)
    if outcome[0] == "ok":
        return outcome[1]
    if failure is not None:
        raise failure
    _, name, message = outcome
    cls = getattr(_errors, name, None)
    if isinstance(cls, type) and issubclass(cls, DistResumeError):
        raise cls(f"{message} (reported by rank 0)")
    raise fallback(f"rank 0 failed: {name}: {message}")
