"""Ranks checking in before a collective entry, through the process group's store.

``save``, ``resume`` and the other collective entries call :func:`check_in` first. Every rank announces the call in
the default process group's store (never a collective: a rank that skipped the call is blocked in its next DDP
all-reduce, and a second all-reduce there would be taken for it) and waits until every rank has announced it. A call
made on some ranks only, such as a save inside ``if rank == 0:``, therefore waits here, where the missing ranks are
known, instead of hanging silently inside a collective:

- after ``DIST_RESUME_COLLECTIVE_WARN`` seconds (default 15) the waiting rank logs one WARNING naming the call, the
  step, the ranks that have not arrived and the fix, and keeps waiting: a rank may arrive late legitimately (rank 0
  evaluating before the save while the others wait);
- at the bound (the manager's ``collective_timeout``, else ``DIST_RESUME_COLLECTIVE_TIMEOUT`` seconds, else the process
  group's own timeout) it raises :class:`~dist_resume.errors.UsageError` with the same words: the script exits and
  torchrun stops the job (the ranks that never arrived get torch's own error or timeout in their next collective).

Ranks that arrive at the same entry with different calls (one saves, another resumes) get a ``UsageError`` at once.
The protocol is torch's own store-based barrier (``_store_based_barrier``): an ``add`` to a counter, the last rank
sets a key the others ``wait`` for; each call of the job is numbered the same on every rank, as collectives are.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from datetime import timedelta
from typing import Any, Final

import torch.distributed as dist

from .._core.errors import UsageError
from .._core.log import logger
from .._core.torch_compat.private import default_store, group_timeout
from .env import is_distributed
from .restarts import warn_restart_risk_once

__all__ = ["WARN_ENV", "TIMEOUT_ENV", "check_in", "timeout_seconds"]

WARN_ENV: Final = "DIST_RESUME_COLLECTIVE_WARN"
TIMEOUT_ENV: Final = "DIST_RESUME_COLLECTIVE_TIMEOUT"
_WARN_S: Final = 15.0
_PREFIX: Final = "dist_resume/checkin"
_ALL_ARRIVED: Final = "1"

# the number of the next check-in, per process group: every rank counts the same calls in the same order
_counts: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_counts_lock = threading.Lock()


def timeout_seconds(value: float | timedelta | None, *, what: str) -> float | None:
    """``value`` (seconds or a timedelta; None: not set) as positive seconds, or a ``UsageError`` naming ``what``."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else value
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < float("inf"):
        raise UsageError(f"{what} must be a positive number of seconds or a timedelta, got {value!r}")
    return float(seconds)


def _env_seconds(name: str) -> float | None:
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        seconds = float(text)
    except ValueError as err:
        raise UsageError(
            f"{name}={text!r} is not a number of seconds: set it to a positive number, or unset it"
        ) from err
    return timeout_seconds(seconds, what=name)


def _next_number(group: Any) -> int:
    with _counts_lock:
        number = _counts.get(group, 0)
        _counts[group] = number + 1
    return number


def _base(number: int) -> str:
    """The keys of check-in ``number``, under the torchrun generation (a restarted job's store may keep the last one's)."""
    return f"{_PREFIX}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/{number}"


def _fix(call: str) -> str:
    return (
        f"{call} is collective: call it on every rank, not inside `if rank == 0:`; dist_resume leaves the writing "
        "and the logging to rank 0 by itself"
    )


def _mismatch(what: str, call: str) -> UsageError:
    return UsageError(
        f"{what}: every rank must make the same dist_resume calls in the same order; " + _fix(call),
        hint="call it on every rank",
    )


def _missing(store: Any, base: str, world_size: int) -> list[int]:
    return [rank for rank in range(world_size) if not store.check([f"{base}/rank{rank}"])]


def check_in(call: str, *, timeout: float | None = None) -> None:
    """Wait until every rank of the default process group has called ``call`` (``"CheckpointManager.save(step=80)"``).

    Collective (through the store only) under torch.distributed with more than one rank; nothing otherwise.
    ``timeout`` (seconds) bounds the wait; None: ``$DIST_RESUME_COLLECTIVE_TIMEOUT``, else the group's timeout.
    Raises :class:`UsageError` when the bound passes, or when another rank checked in with another call.
    """
    if not is_distributed():
        return
    warn_restart_risk_once()  # a script's own init_process_group under --max-restarts (FACTS 45): said at the first call
    group = dist.group.WORLD
    store = default_store()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    number = _next_number(group)
    base = _base(number)
    bound = timeout if timeout is not None else _env_seconds(TIMEOUT_ENV)
    if bound is None:
        bound = group_timeout(group) or store.timeout.total_seconds()
    warn_after = _env_seconds(WARN_ENV) or _WARN_S

    store.set(f"{base}/rank{rank}", call)
    first = store.compare_set(f"{base}/call", "", call).decode(errors="replace")
    if first != call:  # the ranks waiting for this call are told too, instead of waiting for the bound
        mismatch = f"rank {rank} called {call} while another rank called {first} at the same point"
        store.set(f"{base}/all", mismatch)
        raise _mismatch(mismatch, call)
    if store.add(f"{base}/count", 1) == world_size:
        store.set(f"{base}/all", _ALL_ARRIVED)
    if rank == 0 and number >= 2:  # every rank has left the wait of two calls ago: its keys can go
        _forget(store, _base(number - 2), world_size)
    _wait_all(store, base, call, rank, world_size, warn_after=warn_after, bound=bound)


def _wait_all(store: Any, base: str, call: str, rank: int, world_size: int, *, warn_after: float, bound: float) -> None:
    start = time.monotonic()
    warned = False
    while True:
        waited = time.monotonic() - start
        left = (warn_after if not warned else bound) - waited
        try:
            store.wait([f"{base}/all"], timedelta(seconds=max(min(left, bound - waited), 0.001)))
        except RuntimeError:  # the store's wait timed out (DistStoreError is a RuntimeError)
            pass
        else:
            outcome = store.get(f"{base}/all").decode(errors="replace")
            if outcome != _ALL_ARRIVED:
                raise _mismatch(outcome, call)
            return
        waited = time.monotonic() - start
        missing = _missing(store, base, world_size)
        if waited >= bound:
            raise UsageError(
                f"rank {rank} waited {waited:.0f} s in {call} for ranks {missing}, which never called it; "
                + _fix(call),
                hint=f"call it on every rank; the bound is {TIMEOUT_ENV} or CheckpointManager(collective_timeout=)",
            )
        if not warned and waited >= warn_after:
            warned = True
            logger.log(
                logging.WARNING,
                "rank %d has waited %.0f s in %s for ranks %s: %s. Still waiting (until %.0f s): a rank busy with "
                "work of its own before the call (an evaluation on rank 0) arrives late legitimately",
                rank,
                waited,
                call,
                missing,
                _fix(call),
                bound,
            )


def _forget(store: Any, base: str, world_size: int) -> None:
    keys = [f"{base}/rank{rank}" for rank in range(world_size)] + [f"{base}/call", f"{base}/count", f"{base}/all"]
    for key in keys:
        try:
            store.delete_key(key)
        except (RuntimeError, NotImplementedError):  # a store without deletion keeps a few bytes a call
            return
