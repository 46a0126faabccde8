"""The process groups dist_resume makes beside the default one: gloo groups for its background threads (an
asynchronous save's writes, a snapshot's copy into the folder) and for a node's ranks (a snapshot's split copy).

``torch.distributed.new_group`` gives a new group 30 minutes (gloo's default) whatever the default group was given,
so a peer that hangs would hold such a group's collectives for half an hour while the training loop's collectives
give up much sooner. :func:`gloo_group` gives it the default group's timeout instead.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from .._core.torch_compat.private import group_timeout

__all__ = ["gloo_group"]


def gloo_group(ranks: Sequence[int] | None = None, *, timeout: float | None = None) -> Any:
    """A new gloo process group of ``ranks`` (None: every rank) whose collectives wait as long as the default group's,
    or ``timeout`` seconds. Collective: every rank of the default group calls it, in the same order, whether it is in
    ``ranks`` or not.

    Example::

        >>> group = gloo_group()  # doctest: +SKIP
        >>> dist.barrier(group=group)  # doctest: +SKIP
    """
    seconds = group_timeout(dist.group.WORLD) if timeout is None else timeout
    wait = None if seconds is None else datetime.timedelta(seconds=seconds)
    return dist.new_group(None if ranks is None else list(ranks), timeout=wait, backend="gloo")
