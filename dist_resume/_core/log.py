"""The library logger and a rank-0 logging helper that works before a process group exists."""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

__all__ = ["logger", "global_rank", "log_rank0"]

logger = logging.getLogger("dist_resume")


def global_rank() -> int:
    """This process's global rank: from the process group if there is one, else ``RANK``, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def log_rank0(level: int, msg: str, *args: object) -> None:
    """Log on global rank 0 only; ``stacklevel`` points the record at the caller."""
    if global_rank() == 0:
        logger.log(level, msg, *args, stacklevel=2)
