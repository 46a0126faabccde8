"""Where this process sits in the job: torchrun's variables, the device of the local rank, process-group set-up."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._core.errors import EnvironmentMismatchError
from .._core.log import log_rank0
from .._core.rank import check_rank, env_int, rank_and_world
from .accelerator import backend_for, backend_serves, current_accelerator, set_device

__all__ = [
    "RankInfo",
    "rank_info",
    "rank_device",
    "init_distributed",
    "destroy_distributed",
    "is_distributed",
    "launched",
]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """This process's place in the job, as torchrun describes it.

    ``rank`` is global; ``local_rank`` is the index on this node and the one that picks the
    accelerator device; ``node_rank`` is torchrun's ``GROUP_RANK``.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.local_world_size < 1:
            raise EnvironmentMismatchError(
                f"WORLD_SIZE={self.world_size} and LOCAL_WORLD_SIZE={self.local_world_size} must be at least 1"
            )
        check_rank(self.rank, self.world_size)
        if not 0 <= self.local_rank < self.local_world_size:
            raise EnvironmentMismatchError(
                f"LOCAL_RANK={self.local_rank} is outside 0..LOCAL_WORLD_SIZE-1 "
                f"(LOCAL_WORLD_SIZE={self.local_world_size}); launch with torchrun, or set both consistently"
            )
        if self.local_world_size > self.world_size:
            raise EnvironmentMismatchError(
                f"LOCAL_WORLD_SIZE={self.local_world_size} is larger than WORLD_SIZE={self.world_size}"
            )
        if self.node_rank < 0:
            raise EnvironmentMismatchError(f"GROUP_RANK={self.node_rank} must not be negative")

    @property
    def is_distributed(self) -> bool:
        """True when the job has more than one process (``world_size > 1``): there are other ranks to agree with.

        It does not say whether a process group exists: under ``torchrun --nproc_per_node=1``
        :func:`init_distributed` creates one of world size 1 (``torch.distributed.is_initialized()``).
        """
        return self.world_size > 1


def rank_info() -> RankInfo:
    """Read torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and ``GROUP_RANK``.

    Local. Rank and world size follow the one precedence every part of the toolkit uses: the
    initialised process group, else ``RANK`` / ``WORLD_SIZE``, else 0 / 1. The other variables take
    single-process defaults when unset.
    Values that are not integers or are out of range raise :class:`EnvironmentMismatchError`.

    Example::

        >>> info = dist_resume.rank_info()   # plain `python train.py`
        >>> info.rank, info.world_size, info.is_distributed
        (0, 1, False)
    """
    rank, world_size = rank_and_world()
    if "LOCAL_RANK" in os.environ:
        local_rank = env_int("LOCAL_RANK", 0)
        local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    else:  # no launcher told us: assume one node (mp.spawn and friends)
        local_rank = rank
        local_world_size = env_int("LOCAL_WORLD_SIZE", world_size)
    node_rank = env_int("GROUP_RANK", 0)
    return RankInfo(rank, local_rank, world_size, local_world_size, node_rank)


def rank_device(local_rank: int | None = None) -> torch.device:
    """The device this process should use: ``<accelerator>:<LOCAL_RANK>``, or ``cpu`` without an accelerator.

    Local. The accelerator is ``torch.accelerator``'s (cuda, xpu, npu, hpu, mps or a PrivateUse1
    backend such as ``sim``); the index is never the global ``RANK``: on the second node, global rank 2
    is local rank 0. A local rank past the visible devices raises :class:`EnvironmentMismatchError`
    naming the device type, the count and its visible-devices variable; ``mps`` has one device, so a
    second process on a Mac raises too.

    Example::

        >>> dist_resume.rank_device()   # on a CPU-only host
        device(type='cpu')
    """
    if local_rank is None:
        local_rank = rank_info().local_rank
    if local_rank < 0:
        raise EnvironmentMismatchError(f"local_rank={local_rank} must not be negative")
    acc = current_accelerator()
    if acc is None:
        return torch.device("cpu")
    if local_rank >= acc.count:
        raise EnvironmentMismatchError(
            f"LOCAL_RANK={local_rank} but this node has only {acc.describe()}; "
            "start at most that many processes per node (torchrun --nproc_per_node)"
        )
    return torch.device(acc.type, local_rank)


def is_distributed() -> bool:
    """True when a torch.distributed process group is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


# torchrun sets TORCHELASTIC_RUN_ID for every worker; a launcher of its own (mp.spawn with env://, a
# cluster script) sets the variables init_process_group's env:// rendezvous reads
_RENDEZVOUS_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def launched() -> bool:
    """True when a launcher started this process: torchrun (``TORCHELASTIC_RUN_ID``), or every env://
    rendezvous variable (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) is set."""
    return "TORCHELASTIC_RUN_ID" in os.environ or all(os.environ.get(n) for n in _RENDEZVOUS_VARIABLES)


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> RankInfo:
    """Set the local rank's accelerator device and initialise the default process group.

    Collective when launched (torchrun, or ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set):
    call it on every rank. It then creates the group at any world size, one process included
    (``torchrun --nproc_per_node=1``), so a script's unconditional ``DistributedDataParallel(model)``
    and :func:`destroy_distributed` work. A plain ``python train.py`` creates no group and returns
    the single-process :class:`RankInfo`; when a process group already exists it returns at once.

    The device is :func:`rank_device` (``torch.accelerator.set_device_index``). The backend defaults
    to the device type's: ``nccl`` for cuda, ``xccl`` for xpu, ``hccl`` for npu and hpu where torch
    has it, torch's ``Backend.default_device_backend_map`` for other types, ``gloo`` on the CPU
    (docs/devices.md). Under a torchrun elastic restart the rendezvous keys are namespaced by
    ``TORCHELASTIC_RESTART_COUNT`` so a dead attempt's keys cannot confuse the new one.

    Example::

        >>> info = dist_resume.init_distributed()   # plain python: no process group
        >>> info.world_size, torch.distributed.is_initialized()
        (1, False)
    """
    info = rank_info()
    if dist.is_available() and dist.is_initialized():
        return info
    device = rank_device(info.local_rank)
    if device.type != "cpu":
        set_device(device)
    if not info.is_distributed and not launched():
        return info
    if not dist.is_available():
        raise EnvironmentMismatchError(
            f"WORLD_SIZE={info.world_size} but this torch build has no torch.distributed support"
        )
    if backend is None:
        backend = backend_for(device.type)
        if not backend_serves(backend, device.type):
            log_rank0(
                logging.WARNING,
                "torch.distributed has no backend registered for %s tensors; using %s, which does not take them "
                "(object collectives work, DDP does not): import the device's torch plugin that registers its "
                "backend, or pass init_distributed(backend=...)",
                device.type,
                backend,
            )
    kwargs: dict[str, object] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if addr and port:
        store_timeout = timeout or timedelta(minutes=5)
        uses_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        try:
            base = dist.TCPStore(  # type: ignore[attr-defined]
                addr,
                int(port),
                info.world_size,
                is_master=info.rank == 0 and not uses_agent_store,
                timeout=store_timeout,
                wait_for_workers=False,
            )
        except ValueError as err:
            raise EnvironmentMismatchError(f"MASTER_PORT={port!r} is not a valid port") from err
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"dist_resume/attempt_{attempt}", base)  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world_size, **kwargs)  # type: ignore[arg-type]
    else:
        dist.init_process_group(backend, rank=info.rank, world_size=info.world_size, **kwargs)  # type: ignore[arg-type]
    log_rank0(logging.DEBUG, "initialised %s process group: world size %d", backend, info.world_size)
    return info


def destroy_distributed() -> None:
    """Destroy the default process group if one exists; do nothing otherwise.

    Call it on every rank at the end, after the last collective (and after ``AsyncSave.wait()`` and the
    ``CheckpointManager.close()`` of a manager that snapshots: their background threads use process groups too): it
    ends the group :func:`init_distributed` created (or one the script created itself), and is safe
    to call in a plain single process, where there is none. It communicates nothing.

    Example::

        >>> dist_resume.destroy_distributed()   # plain python: no process group, nothing to do
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        log_rank0(logging.DEBUG, "destroyed the default process group")
