"""The one answer to "which rank is this process, in how large a job": every module asks here."""

from __future__ import annotations

import os

import torch.distributed as dist

from .errors import EnvironmentMismatchError

__all__ = ["env_int", "check_rank", "rank_and_world", "global_rank"]


def env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name``; ``default`` when unset or blank.

    Raises :class:`EnvironmentMismatchError` naming the variable when it holds something else.
    """
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvironmentMismatchError(
            f"environment variable {name}={raw!r} is not an integer; it is set by torchrun, unset it or fix it"
        ) from None


def check_rank(rank: int, world_size: int) -> None:
    """Raise :class:`EnvironmentMismatchError` unless ``world_size >= 1`` and ``0 <= rank < world_size``."""
    if world_size < 1:
        raise EnvironmentMismatchError(f"WORLD_SIZE={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise EnvironmentMismatchError(
            f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world_size}); "
            "launch with torchrun, or set RANK and WORLD_SIZE consistently"
        )


def rank_and_world() -> tuple[int, int]:
    """(global rank, world size) of this process. Local.

    Precedence, the same for every caller in dist_resume:

    1. the initialised default process group (``dist.get_rank()``, ``dist.get_world_size()``): once it
       exists it is what every collective uses, whatever the environment says;
    2. torchrun's ``RANK`` and ``WORLD_SIZE`` (each on its own; blank counts as unset), before a
       process group exists;
    3. ``0`` and ``1``: a plain ``python train.py``.

    A variable that is not an integer, or a rank outside ``0..WORLD_SIZE-1``, raises
    :class:`EnvironmentMismatchError` naming the values.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = env_int("RANK", 0), env_int("WORLD_SIZE", 1)
    check_rank(rank, world_size)
    return rank, world_size


def global_rank() -> int:
    """This process's global rank, by :func:`rank_and_world`'s precedence. Local."""
    return rank_and_world()[0]
