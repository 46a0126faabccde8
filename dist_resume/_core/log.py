"""The library logger and a rank-0 logging helper that works before a process group exists."""

from __future__ import annotations

import logging

from .errors import EnvironmentMismatchError
from .rank import global_rank

__all__ = ["logger", "log_rank0"]

logger = logging.getLogger("dist_resume")


def log_rank0(level: int, msg: str, *args: object) -> None:
    """Log on global rank 0 only; ``stacklevel`` points the record at the caller.

    The rank comes from :func:`dist_resume._core.rank.global_rank`. Logging never raises: with a
    ``RANK`` that is not an integer this process logs as rank 0 (``rank_info`` reports the bad value).
    """
    try:
        rank0 = global_rank() == 0
    except EnvironmentMismatchError:
        rank0 = True
    if rank0:
        logger.log(level, msg, *args, stacklevel=2)
