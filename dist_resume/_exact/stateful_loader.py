"""torchdata's StatefulDataLoader saved and restored per rank.

A plain ``DataLoader`` with ``num_workers > 0`` draws indices from its sampler in the main process,
``prefetch_factor`` batches per worker ahead of the training loop, so a sampler's own position counts
samples the loop never trained on. torchdata's ``StatefulDataLoader`` (FACTS 34, an optional
dependency: nothing here imports it) snapshots the sampler's ``state_dict()`` when each batch's
indices are drawn and hands out the snapshot of the batch it yields: its ``state_dict()`` is exact
with workers, and restores a ``ResumableDistributedSampler`` (through the sampler's own
``load_state_dict``) or a plain ``DistributedSampler`` (by skipping what it yielded) inside it.

The entry this module writes per rank (:func:`loader_state`, plain values, loads under
``weights_only=True``) is ``{"kind", "state", "sampler", "rank", "world_size", "num_workers",
"num_samples", "epoch"}``. What a restore does (:func:`check_loader_state`, then
:func:`restore_loader`):

- same world size and ``num_workers``: the rank's own entry goes to ``loader.load_state_dict`` (worker
  RNG seeds and counters included; a plain ``DistributedSampler`` gets its saved epoch first), except that a
  ``ResumableDistributedSampler`` at the start of an epoch (the one before ended) without persistent workers
  gets a fresh iterator, as the uninterrupted run does;
- another world size or ``num_workers``, with a ``ResumableDistributedSampler`` inside: only the
  sampler is restored, from the exact position in the entry (the same on every rank), and the loader
  starts a fresh iterator: the rest of the epoch is split over the ranks present now and every sample
  is seen once. Per-rank loader state (worker seeds, counters) does not carry over, since ranks no
  longer correspond; a plain ``DataLoader`` holding the sampler takes this path too;
- another world size with a plain ``DistributedSampler`` (its skip count points into another
  partition), another ``num_workers`` with any sampler but ours, an iterable dataset whose world
  changed, or a saved state that is not torchdata's: refused with :class:`StateMismatchError` before
  anything changes.

Wired by :class:`~dist_resume._exact.loaders.StatefulLoaderPosition` (what ``dataloader=`` becomes for one): a
save gathers every rank's entry with its RNG state and rank 0 stores them as one list (index = rank) under the
data position's ``"loader"`` key, next to the exact sampler position (:func:`loader_position`), so that a resume
without the loader, or at another world size, still continues the epoch.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from torch.utils.data import DistributedSampler

from .._core.errors import StateMismatchError
from .._core.log import log_rank0
from .._core.rank import rank_and_world
from .sampler import ResumableDistributedSampler, check_sampler_state

__all__ = [
    "LOADER_KIND",
    "LoaderRestore",
    "RestoreMode",
    "is_stateful_loader",
    "loader_sampler",
    "loader_state",
    "loader_position",
    "merge_loader_states",
    "check_loader_state",
    "restore_loader",
]

LOADER_KIND: Final = "torchdata.StatefulDataLoader"
# the keys torchdata 0.11's iterators read back: single process, and with workers (plus its snapshot's)
_SINGLE_KEYS: Final = frozenset({"_num_yielded", "_sampler_iter_yielded", "_iterator_finished"})
_MULTI_KEYS: Final = frozenset({"_snapshot", "_steps_since_snapshot", "_iterator_finished"})
_SNAPSHOT_KEYS: Final = frozenset({"_main_snapshot", "_worker_snapshots", "_snapshot_step"})


def is_stateful_loader(obj: Any) -> bool:
    """Whether ``obj`` is a torchdata ``StatefulDataLoader`` (or a subclass); never imports torchdata. Local."""
    return any(c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.") for c in type(obj).__mro__)


def loader_sampler(loader: Any) -> Any:
    """The sampler that draws indices for ``loader``: its batch sampler's ``sampler`` when it has one, else ``sampler``."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return inner if inner is not None else getattr(loader, "sampler", None)


def _sampler_kind(sampler: Any) -> str | None:
    if isinstance(sampler, ResumableDistributedSampler):
        return "ResumableDistributedSampler"
    if isinstance(sampler, DistributedSampler):
        return "DistributedSampler"
    return None if sampler is None else type(sampler).__name__


def _partition(sampler: Any) -> tuple[int, int]:
    if isinstance(sampler, (ResumableDistributedSampler, DistributedSampler)):
        return int(sampler.rank), int(sampler.num_replicas)
    return rank_and_world()


def _length(loader: Any) -> int | None:
    try:
        return len(loader.dataset)
    except TypeError:  # an iterable dataset without __len__
        return None


def loader_state(loader: Any, state: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This rank's entry for a ``StatefulDataLoader``: its ``state_dict()`` (or ``state``, ``{}`` for a loader that
    has not iterated) and what a restore must match. Local.

    Example::

        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> s = dist_resume.ResumableDistributedSampler(range(8), num_replicas=1, rank=0)
        >>> loader = StatefulDataLoader(range(8), batch_size=2, sampler=s)
        >>> it = iter(loader); _ = next(it)
        >>> loader_position(loader_state(loader))["consumed"]
        2
    """
    if not is_stateful_loader(loader):
        raise TypeError(f"loader_state() takes a torchdata StatefulDataLoader, got {type(loader).__name__}")
    sampler = loader_sampler(loader)
    rank, world = _partition(sampler)
    epoch = int(sampler.epoch) if isinstance(sampler, DistributedSampler) else None
    return {
        "kind": LOADER_KIND,
        "state": dict(loader.state_dict() if state is None else state),
        "sampler": _sampler_kind(sampler),
        "rank": rank,
        "world_size": world,
        "num_workers": int(loader.num_workers),
        "num_samples": _length(loader),
        "epoch": epoch,
    }


def _main_state(state: Mapping[str, Any]) -> tuple[Mapping[str, Any], int]:
    """The main process's part of a StatefulDataLoader state and the batches yielded since it was taken."""
    if "_snapshot" in state:
        return state["_snapshot"]["_main_snapshot"], int(state["_steps_since_snapshot"])
    return state, 0


def loader_position(entry: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``ResumableDistributedSampler`` state inside a :func:`loader_state` entry: the position of what the loop
    consumed (exact with workers), or None when the sampler is another kind or the state lags behind (torchdata's
    ``snapshot_every_n_steps`` above 1, between snapshots). Local."""
    if entry.get("sampler") != "ResumableDistributedSampler" or not entry["state"]:
        return None
    main, since = _main_state(entry["state"])
    if since:
        return None
    own = main.get("_index_sampler_state")  # batch_size=None: the sampler is the index sampler
    if isinstance(own, Mapping) and "consumed" in own:
        return dict(own)
    nested = main.get("_sampler_iter_state")  # torchdata's BatchSampler iterator keeps the sampler's state
    found = nested.get("sampler_state") if isinstance(nested, Mapping) else None
    return dict(found) if isinstance(found, Mapping) else None


def merge_loader_states(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Every rank's :func:`loader_state` entry, checked to agree: the checkpoint's list (index = rank).

    Local (on rank 0, after the gather). Raises :class:`StateMismatchError` when the ranks'
    ``ResumableDistributedSampler`` positions differ (they drew different numbers of batches).
    """
    positions = [(p.get("epoch"), p.get("consumed")) if (p := loader_position(e)) else None for e in entries]
    known = {p for p in positions if p is not None}
    if len(known) > 1:
        raise StateMismatchError(
            f"the ranks' StatefulDataLoaders are at different positions (epoch, samples consumed): {positions}; "
            "every rank must draw the same number of batches before saving"
        )
    return [dict(e) for e in entries]


class RestoreMode(enum.Enum):
    """How :func:`restore_loader` restores a loader."""

    FULL = "full"  # the rank's own entry through loader.load_state_dict
    SAMPLER = "sampler"  # the exact position into the ResumableDistributedSampler; the loader starts afresh


@dataclass(frozen=True)
class LoaderRestore:
    """What :func:`restore_loader` will do; :func:`check_loader_state` validated it and changed nothing."""

    loader: Any
    mode: RestoreMode
    state: Any  # the loader's state (FULL; {} for one that had not iterated) or the sampler's (SAMPLER)
    epoch: int | None  # a plain DistributedSampler's epoch, set before the loader's state is loaded
    note: str | None = None
    position: dict[str, Any] | None = None  # the ResumableDistributedSampler's, when known


def _fail(source: str, what: str, fix: str) -> StateMismatchError:
    return StateMismatchError(f"{source}: {what}; {fix}. Nothing was restored")


def check_loader_state(
    loader: Any, saved: Any, *, source: str = "checkpoint", counted: Mapping[str, Any] | None = None
) -> LoaderRestore:
    """Validate ``saved`` (the checkpoint's list of :func:`loader_state` entries) against ``loader``; change nothing.

    Local. Picks this rank's entry and the way to restore it (see the module docstring), and raises
    :class:`StateMismatchError` for a state that cannot be restored exactly. ``counted``: the sampler position
    saved beside entries that hold none (a ``batch_sampler`` without ``state_dict``, which torchdata fast-forwards
    by the batches it drew: the sampler is set to the start of that pass).
    """
    if not (isinstance(saved, Sequence) and saved and all(isinstance(e, Mapping) for e in saved)):
        raise _fail(source, "the dataloader entry is not a list of per-rank StatefulDataLoader states", _DROP)
    if any(e.get("kind") != LOADER_KIND or not isinstance(e.get("state"), Mapping) for e in saved):
        raise _fail(source, f"the dataloader entry holds states that are not {LOADER_KIND}'s", _DROP)
    sampler = loader_sampler(loader)
    kind = _sampler_kind(sampler)
    rank, world = _partition(sampler)
    first = saved[0]
    saved_world, saved_kind, length = len(saved), first.get("sampler"), _length(loader)
    if first.get("num_samples") is not None and length is not None and first["num_samples"] != length:
        raise _fail(source, f"the dataset had {first['num_samples']} samples when saved, {length} now", _SAME_DATA)
    if saved_kind != kind:
        raise _fail(source, f"the loader's sampler was {saved_kind} when saved, is {kind} now", _SAME_DATA)
    same_workers = is_stateful_loader(loader) and all(e.get("num_workers") == loader.num_workers for e in saved)
    if world == saved_world and same_workers:
        entry = saved[rank]
        if entry["state"]:
            _check_torchdata_keys(entry["state"], source)
        position = loader_position(entry) or counted
        if position is not None:
            check_sampler_state(sampler, position, source)
            position = _next_sample(sampler, position)
            if position["consumed"] == 0 and not (loader.num_workers and loader.persistent_workers):
                return LoaderRestore(loader, RestoreMode.SAMPLER, position, None, None, position)  # a new epoch
            position = position if loader_position(entry) else {**position, "consumed": 0}
        return LoaderRestore(loader, RestoreMode.FULL, entry["state"], entry.get("epoch"), None, position)
    if kind == "ResumableDistributedSampler":
        position = loader_position(first) or counted
        if position is None:
            raise _fail(
                source,
                "the saved loader state lags behind its last batches (snapshot_every_n_steps > 1)",
                "save with snapshot_every_n_steps=1 (the default) to resume at another world size or num_workers",
            )
        check_sampler_state(sampler, position, source)
        why = f"{saved_world} rank(s) then, {world} now" if world != saved_world else "num_workers changed"
        note = f"{source}: the dataloader restarts its iterator and the sampler continues the epoch exactly ({why})"
        position = _next_sample(sampler, position)
        return LoaderRestore(loader, RestoreMode.SAMPLER, position, None, note, position)
    if world != saved_world:
        what = f"the loader state was saved by {saved_world} rank(s), {world} now, and its {kind} cannot be re-split"
        fix = "resume at the same world size, or use a ResumableDistributedSampler inside the StatefulDataLoader"
    else:
        what = "num_workers changed (or dataloader= is not a StatefulDataLoader) since the loader state was saved"
        fix = "keep num_workers and the StatefulDataLoader, or use a ResumableDistributedSampler inside it"
    raise _fail(source, what, fix)


def _next_sample(sampler: ResumableDistributedSampler, position: Mapping[str, Any]) -> dict[str, Any]:
    """``position`` with an epoch that has nothing left on this rank's world moved to the next epoch's start."""
    epoch, consumed = sampler._normalized(int(position["epoch"]), int(position["consumed"]))
    return {**position, "epoch": epoch, "consumed": consumed}


_DROP: Final = "resume without dataloader= to start the epoch afresh"
_SAME_DATA: Final = "resume with the same dataset and sampler, or without dataloader= to start the epoch afresh"


def _check_torchdata_keys(state: Mapping[str, Any], source: str) -> None:
    snapshot = state.get("_snapshot")
    ok = (
        _MULTI_KEYS <= set(state) and isinstance(snapshot, Mapping) and _SNAPSHOT_KEYS <= set(snapshot)
        if "_snapshot" in state
        else _SINGLE_KEYS <= set(state)
    )
    if not ok:
        raise _fail(source, "the saved StatefulDataLoader state lacks keys torchdata reads back", _DROP)


def restore_loader(restore: LoaderRestore) -> None:
    """Apply what :func:`check_loader_state` validated. Local; the loader's next ``iter()`` continues the epoch."""
    sampler = loader_sampler(restore.loader)
    if restore.mode == RestoreMode.SAMPLER:
        if is_stateful_loader(restore.loader):
            _fresh(restore.loader)
        sampler.load_state_dict(restore.state)
        if restore.note:
            log_rank0(logging.INFO, "%s", restore.note)
        return
    if restore.epoch is not None:
        sampler.set_epoch(restore.epoch)
    elif restore.position is not None:  # torchdata loads it at the next iter(); sampler.epoch is right from now on
        sampler.load_state_dict(restore.position)
    if restore.state:
        restore.loader.load_state_dict(restore.state)
    else:
        _fresh(restore.loader)


def _fresh(loader: Any) -> None:
    """Drop the iterator ``loader`` holds and any state it would start one from: the next one starts afresh."""
    loader.load_state_dict({})
    loader.next_iter_state = None  # load_state_dict({}) keeps a state loaded before
