"""Whether the live state is still what a snapshot holds: what ``save(step)`` asks before it copies the snapshot of
``step`` into the folder instead of saving the live state.

Decided by evidence, never by the step number (a scheduler stepped, an EMA updated or a weight edited between
``snapshot(step)`` and ``save(step)`` is the live state of ``step``, and the snapshot's bytes are not). All of:

- **the small states**, compared whole: the file's object is pickled again exactly as the snapshot's ``data.pkl`` was
  (:func:`~.payload.pickled`), its ``saved_at`` set to the snapshot's, and the bytes must be equal. That covers every
  value that is not a tensor's data (the scheduler, the scaler, the optimizer's hyperparameters, the data position,
  the epoch, ``extra``, Python's and numpy's RNG states) and every tensor's shape and dtype.
- **the same tensors**: each over the same memory as the snapshot's (the same address, shape, strides and dtype: the
  snapshot keeps its tensors alive, so no other tensor can be there), its version counter where it has the live
  one's (torch bumps it at an in-place change: ``copy_``, ``load_state_dict``, an EMA update, an edit under
  ``no_grad``). One that is not, or a tensor made anew for each payload (torch's RNG states), is compared byte for
  byte with its record in the slot when it is small (:data:`COMPARED_BYTES`); a larger one counts as changed.
- **the live tensors' version counters**, summed (they only grow): the model's parameters and buffers, the optimizer's
  state, the EMA's, each FSDP2 one's local shard (whose ``state_dict()`` copy has a counter of its own).
- **the optimizer's steps**, counted by a step hook on it: a fused optimizer (``fused=True``) writes its parameters
  and state without bumping their counters.

What none of this sees: a change through ``tensor.data`` (a counter of its own) or by code that writes a tensor's
memory outside torch's operators (BatchNorm's running mean and variance are such, but ``num_batches_tracked``, which
every forward in training mode increments, is not). Such a loop takes ``snapshot(step)`` again before ``save(step)``.
"""

from __future__ import annotations

import itertools
import mmap
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch

from ..._checkpoint.objects import LiveObjects
from ..._core.shards import local_of
from ..._layout.layout import Key
from .payload import LaidOut, pickled, record_view

__all__ = ["COMPARED_BYTES", "Evidence", "optimizer_steps", "changed_since"]

COMPARED_BYTES: Final = 1 << 20
"""A tensor that is not shown unchanged otherwise is compared with the snapshot's bytes up to this size; a larger one
counts as changed (its comparison would cost a copy)."""

_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def _count_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    _steps[optimizer] += 1


def optimizer_steps(optimizer: Any) -> int | None:
    """How many steps ``optimizer`` took since this process first asked (a step hook counts them from then on); None
    for an object that is no torch optimizer. Local."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    if optimizer not in _steps:
        _steps[optimizer] = 0
        optimizer.register_step_post_hook(_count_step)
    return _steps[optimizer]


def _live_tensors(live: LiveObjects) -> Iterator[torch.Tensor]:
    for module in (live.model, live.ema):
        if module is not None:
            yield from itertools.chain(module.parameters(), module.buffers())
    if live.optimizer is not None:
        for state in live.optimizer.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def live_versions(live: LiveObjects) -> int:
    """The sum of the live tensors' version counters (each DTensor's local shard's). Local."""
    return sum(local_of(t)._version for t in _live_tensors(live))


@dataclass(frozen=True)
class Evidence:
    """What the snapshot of ``step`` held: its ``data.pkl`` and ``saved_at``, its tensors (kept alive: their memory and
    version counters stand for the live ones) with their versions then, its records (``laid``) in the slot's file
    ``path``, and the live tensors' versions and the optimizer's steps then."""

    step: int
    laid: LaidOut
    saved_at: Any
    versions: tuple[int, ...]
    path: Path
    live_versions: int
    steps: int | None

    @staticmethod
    def of(step: int, written: dict[str, Any], laid: LaidOut, path: Path, live: LiveObjects) -> Evidence:
        """The evidence of a snapshot of ``step`` whose file ``path`` holds ``written`` laid out as ``laid``, taken
        from ``live``. Local."""
        meta = _meta(written)
        saved_at = None if meta is None else meta.get("saved_at")
        versions = tuple(t._version for t in laid.tensors)
        return Evidence(step, laid, saved_at, versions, path, live_versions(live), optimizer_steps(live.optimizer))


def _meta(written: dict[str, Any]) -> dict[str, Any] | None:
    """The ``meta`` entry of what a snapshot's file holds: a payload's, or an FSDP2 rank's own shards' (in their
    train state)."""
    for holder in (written, written.get("train_state")):
        meta = holder.get(Key.META) if isinstance(holder, dict) else None
        if isinstance(meta, dict):
            return meta
    return None


def _same_memory(live: torch.Tensor, held: torch.Tensor) -> bool:
    return (
        live.data_ptr() == held.data_ptr()
        and live.dtype == held.dtype
        and live.device == held.device
        and live.shape == held.shape
        and live.stride() == held.stride()
    )


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().reshape(-1).contiguous().view(torch.uint8)


def changed_since(evidence: Evidence, written: dict[str, Any], mm: mmap.mmap | None, live: LiveObjects) -> str | None:
    """None when ``written`` (what the snapshot's file would hold now, built from ``live`` as the snapshot's was) holds
    what the snapshot of ``evidence.step`` holds; else what changed (for a DEBUG line). ``mm``: the snapshot's slot,
    mapped (None: nothing is compared byte for byte). Local; changes nothing but ``written``'s ``saved_at``."""
    if optimizer_steps(live.optimizer) != evidence.steps:
        return "the optimizer stepped"
    if live_versions(live) != evidence.live_versions:
        return "a live tensor was changed in place"
    meta = _meta(written)
    if meta is not None and "saved_at" in meta:
        meta["saved_at"] = evidence.saved_at
    now = pickled(written)
    if now is None or len(now.tensors) != len(evidence.laid.tensors):
        return "its tensors are not the snapshot's"
    if now.data != evidence.laid.pickled:
        return "a value that is not a tensor's data changed (a scheduler, the optimizer's hyperparameters, ...)"
    for i, (tensor, held, version) in enumerate(zip(now.tensors, evidence.laid.tensors, evidence.versions)):
        if _same_memory(tensor, held) and held._version == version:
            continue
        record = evidence.laid.records[i]
        if mm is None or record.nbytes > COMPARED_BYTES:
            return f"tensor {i} {tuple(tensor.shape)} was changed in place or replaced"
        saved = record_view(mm, record)
        try:
            if not torch.equal(_bytes(tensor.cpu()), _bytes(saved)):
                return f"tensor {i} {tuple(tensor.shape)} holds other values"
        finally:
            del saved
    return None
