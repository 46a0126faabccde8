"""Object collectives that need nothing but torch.

torch's ``broadcast_object_list`` / ``all_gather_object`` / ``gather_object`` decode through
``tensor.numpy()`` and fail with "Numpy is not available" on a torch-only install; these pickle into
a uint8 tensor and read it back with ``ctypes``, on the backend's device.

A collective that fails because a peer died or timed out raises torch's ``RuntimeError``;
:func:`collective_step` turns it into a dist_resume error that names the step this rank was in.
"""

from __future__ import annotations

import ctypes
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._core import errors as _errors
from .._core.errors import CheckpointWriteError, DistResumeError, rebuild_error
from .._core.log import logger
from .._core.rank import global_rank
from .._core.torch_compat.private import object_collective_device_type, tensor_owners
from .._core.torch_compat.wording import CommFailure, classify_comm_error, comm_error_summary
from .accelerator import current_device
from .env import is_distributed

__all__ = [
    "comm_device",
    "released_by_backend",
    "broadcast_object",
    "all_gather_objects",
    "RESTART_HINT",
    "collective_step",
    "RelayedError",
    "Outcome",
    "relabel",
    "run_on_rank0",
]


def comm_device(group: Any = None) -> torch.device:
    """Where ``group``'s (None: the default group's) object collectives put their bytes: torch's own choice for
    ``broadcast_object_list`` (``cpu`` whenever the group has a CPU backend, as ``gloo`` and
    ``"cpu:gloo,cuda:nccl"`` do; else the device type of its one backend: the current cuda device for
    ``nccl``, the current xpu device for ``xccl``, ...). Payloads are pickled bytes, read back on the CPU."""
    kind = object_collective_device_type(group)
    return torch.device("cpu") if kind == "cpu" else current_device(kind)


# How long to wait for gloo's worker thread to let go of a finished collective's tensors: it does within
# microseconds; the bound only keeps an unexpected extra owner from stalling the caller.
_RELEASE_WAIT_S = 1.0


@contextmanager
def released_by_backend(*tensors: torch.Tensor) -> Iterator[None]:
    """Local: run synchronous collectives on ``tensors`` inside; leave once the backend's threads own none of them.

    Under gloo a collective returns while the backend's worker thread still holds its tensors for a moment;
    a tensor Python drops first is later freed by that thread, which then needs the GIL and aborts the
    process if the interpreter is exiting (:func:`dist_resume._core.torch_compat.private.tensor_owners` says more).
    Waiting here, with the GIL released, means every dist_resume collective is over when it returns, so a
    script may exit right after one. Only CPU tensors under a gloo backend (``"gloo"``, ``"cpu:gloo,cuda:nccl"``)
    are waited for; other backends and devices are left as they are.
    """
    cpu = [t for t in tensors if t.device.type == "cpu"]
    if not cpu or "gloo" not in dist.get_backend():
        yield
        return
    before = [tensor_owners(t) for t in cpu]
    yield
    deadline = time.monotonic() + _RELEASE_WAIT_S
    pause = 1e-6
    while any(tensor_owners(t) > n for t, n in zip(cpu, before)):
        if time.monotonic() > deadline:
            logger.debug("gloo still holds a finished collective's tensors after %.1f s", _RELEASE_WAIT_S)
            return
        time.sleep(pause)  # releases the GIL: the worker may need it to let go
        pause = min(pause * 2, 1e-3)


def _encode(obj: Any, device: torch.device) -> torch.Tensor:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _decode(buf: torch.Tensor, size: int) -> Any:
    cpu = buf[:size].cpu().contiguous()
    return pickle.loads(ctypes.string_at(cpu.data_ptr(), size))


def broadcast_object(obj: Any, src: int = 0, group: Any = None) -> Any:
    """Collective: every rank returns ``src``'s ``obj`` (others pass anything, e.g. None); ``group``: a process
    group of every rank (None: the default one)."""
    device = comm_device(group)
    payload = _encode(obj, device) if dist.get_rank() == src else None
    size = torch.tensor([payload.numel() if payload is not None else 0], dtype=torch.int64, device=device)
    with released_by_backend(size):
        dist.broadcast(size, src=src, group=group)
    n = int(size.item())
    buf = payload if payload is not None else torch.empty(n, dtype=torch.uint8, device=device)
    with released_by_backend(buf):
        dist.broadcast(buf, src=src, group=group)
    return obj if dist.get_rank() == src else _decode(buf, n)


def all_gather_objects(obj: Any, group: Any = None) -> list[Any]:
    """Collective: every rank returns the list of all ranks' ``obj``, indexed by rank (``group``: as above)."""
    device = comm_device(group)
    payload = _encode(obj, device)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    own_size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    with released_by_backend(own_size, *sizes):
        dist.all_gather(sizes, own_size, group=group)
    counts = [int(s.item()) for s in sizes]
    longest = max(counts)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    bufs = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)]
    with released_by_backend(padded, *bufs):
        dist.all_gather(bufs, padded, group=group)
    return [_decode(buf, n) for buf, n in zip(bufs, counts)]


RESTART_HINT = (
    "a rank died, is stuck, or did not make the same call; check every rank's log for the first error, "
    "then restart the job"
)

_CAUSES = {
    CommFailure.PEER_GONE: "another rank's process is gone",
    CommFailure.TIMEOUT: "no answer within the process-group timeout",
    CommFailure.OTHER: "the collective failed",
}


@contextmanager
def collective_step(step: str, error: type[DistResumeError], hint: str = RESTART_HINT) -> Iterator[None]:
    """Local: a torch.distributed failure inside the block (a peer died, a timeout) raises ``error``
    whose message names ``step`` ("receiving the broadcast checkpoint (bucket 3 of 7)") and ``hint``.

    Wrap only collective calls: every ``RuntimeError`` inside counts as one (torch raises gloo's
    failures as plain ``RuntimeError``; ``DistBackendError`` and ``DistNetworkError`` subclass it).
    dist_resume errors and anything that is no ``RuntimeError`` pass through unchanged.
    """
    try:
        yield
    except DistResumeError:
        raise
    except RuntimeError as err:
        rank = global_rank()
        cause = _CAUSES[classify_comm_error(err)]
        raise error(
            f"rank {rank}: lost contact with the other ranks while {step}: {cause} ({comm_error_summary(err)}); {hint}"
        ) from err


@dataclass(frozen=True)
class RelayedError:
    """An exception on its way from the rank it happened on to the others.

    ``pickled`` is the exception itself where it pickles (class and every attribute survive);
    ``type_name``, ``message`` and ``attributes`` (those that pickle; others as their repr) are the
    fallback for an exception that does not, or whose class the receiving rank cannot import.
    """

    rank: int
    type_name: str  # module.qualname
    message: str
    attributes: dict[str, Any]
    pickled: bytes | None

    @classmethod
    def of(cls, rank: int, err: BaseException) -> RelayedError:
        try:
            pickled: bytes | None = pickle.dumps(err, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # a lambda, a lock, a local class...: the fallback fields carry it
            pickled = None
        attributes = {key: _picklable(value) for key, value in vars(err).items()}
        name = f"{type(err).__module__}.{type(err).__qualname__}"
        return cls(rank, name, str(err), attributes, pickled)

    @property
    def class_name(self) -> str:
        return self.type_name.rpartition(".")[2]

    def rebuild(self, fallback: type[DistResumeError]) -> DistResumeError:
        """The error to raise on this rank: the same class with its attributes and ``rank`` set.

        An exception that is no :class:`DistResumeError` becomes ``fallback`` (its message names the
        original class), chained to the original where that unpickles.
        """
        original: BaseException | None = None
        if self.pickled is not None:
            try:
                original = pickle.loads(self.pickled)
            except Exception:  # its class does not import here: use the fallback fields
                original = None
        if isinstance(original, DistResumeError):
            err = original
        else:
            # exported classes show the public path (dist_resume.X); both name the class in _core.errors
            module = self.type_name.rpartition(".")[0]
            ours = module == "dist_resume" or module.startswith("dist_resume.")
            cls = getattr(_errors, self.class_name, None) if ours else None
            if isinstance(cls, type) and issubclass(cls, DistResumeError):
                err = rebuild_error(cls, self.message, self.attributes)
            else:
                err = fallback(f"{self.class_name}: {self.message}")
                err.__cause__ = original
        err.rank = self.rank
        return err


def _picklable(value: Any) -> Any:
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return repr(value)
    return value


@dataclass(frozen=True)
class Outcome:
    """What one rank's step came to: ``value``, or ``error`` (which rank failed, and how)."""

    value: Any = None
    error: RelayedError | None = None

    @classmethod
    def failed(cls, rank: int, err: BaseException) -> Outcome:
        return cls(error=RelayedError.of(rank, err))

    @classmethod
    def run(cls, fn: Callable[[], Any], rank: int) -> tuple[Outcome, Exception | None]:
        """Run ``fn``; the outcome to send, and the exception itself (to re-raise on this rank)."""
        try:
            return cls(value=fn()), None
        except Exception as err:  # relayed to the other ranks by the caller
            return cls.failed(rank, err), err


def relabel(err: DistResumeError, message: str) -> DistResumeError:
    """``err`` with a new message; class, attributes and ``rank`` unchanged."""
    err.args = (message, *err.args[1:])
    return err


def run_on_rank0(
    fn: Callable[[], Any],
    fallback: type[DistResumeError] = CheckpointWriteError,
    *,
    task: str = "write the checkpoint",
    hint: str = RESTART_HINT,
    group: Any = None,
) -> Any:
    """Run ``fn`` on global rank 0 only; every rank returns its result or raises its error.

    Collective under torch.distributed (one broadcast), so a failure on rank 0 never leaves the
    other ranks waiting in a barrier. Rank 0 raises its own exception; the others raise the same
    dist_resume error class with its attributes and ``rank == 0`` (``fallback`` for any other
    exception, chained to it). If rank 0 dies or the broadcast times out, the waiting ranks raise
    ``fallback`` naming ``task`` ("while waiting for rank 0 to write the checkpoint") and ``hint``.
    ``group``: a process group of every rank (None: the default one).
    """
    if not is_distributed():
        return fn()
    rank0 = dist.get_rank() == 0
    outcome, failure = Outcome.run(fn, 0) if rank0 else (None, None)
    step = f"telling the other ranks whether rank 0 could {task}" if rank0 else f"waiting for rank 0 to {task}"
    try:
        with collective_step(step, fallback, hint):
            received: Outcome = broadcast_object(outcome, src=0, group=group)
    except DistResumeError as lost:
        if failure is None:
            raise
        logger.warning("%s", lost)  # rank 0's own failure comes first
    if failure is not None:
        raise failure
    if received.error is None:
        return received.value
    relayed: RelayedError = received.error
    err = relayed.rebuild(fallback)
    same = type(err).__qualname__ == relayed.class_name
    raise relabel(err, f"{relayed.message} (reported by rank 0)" if same else f"rank 0 failed: {err}")
