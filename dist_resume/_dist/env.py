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

__all__ = ["RankInfo", "rank_info", "rank_device", "init_distributed", "is_distributed"]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """This process's place in the job, as torchrun describes it.

    ``rank`` is global; ``local_rank`` is the index on this node and the one that picks the GPU;
    ``node_rank`` is torchrun's ``GROUP_RANK``.
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
        """True when the job has more than one process."""
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
    """The device this process should use: ``cuda:<LOCAL_RANK>`` when CUDA is available, else ``cpu``.

    Local. It is never indexed by the global ``RANK``: on the second node, global rank 2 is local rank 0.

    Example::

        >>> dist_resume.rank_device()   # on a CPU-only host
        device(type='cpu')
    """
    if local_rank is None:
        local_rank = rank_info().local_rank
    if local_rank < 0:
        raise EnvironmentMismatchError(f"local_rank={local_rank} must not be negative")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise EnvironmentMismatchError(
            f"LOCAL_RANK={local_rank} but this node has only {count} visible CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
            "start at most that many processes per node (torchrun --nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def is_distributed() -> bool:
    """True when a torch.distributed process group is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def init_distributed(backend: str | None = None, timeout: timedelta | None = None) -> RankInfo:
    """Set the local rank's CUDA device and initialise the default process group.

    Collective when ``WORLD_SIZE > 1``: call it on every rank. With one process it initialises
    nothing and returns the single-process :class:`RankInfo`; when a process group already exists
    it returns at once (idempotent).

    The backend defaults to ``nccl`` when CUDA is available, else ``gloo``. Under a torchrun
    elastic restart the rendezvous keys are namespaced by ``TORCHELASTIC_RESTART_COUNT`` so a dead
    attempt's keys cannot confuse the new one.

    Example::

        >>> info = dist_resume.init_distributed()   # no-op in a single process
        >>> info.world_size
        1
    """
    info = rank_info()
    if dist.is_available() and dist.is_initialized():
        return info
    device = rank_device(info.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not info.is_distributed:
        return info
    if not dist.is_available():
        raise EnvironmentMismatchError(
            f"WORLD_SIZE={info.world_size} but this torch build has no torch.distributed support"
        )
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
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
    log_rank0(logging.INFO, "initialised %s process group: world size %d", backend, info.world_size)
    return info
