"""What a save refuses before it writes anything: a state whose checkpoint the library would then refuse to resume.

A checkpoint is worth writing only if it resumes. ``torch.save`` writes sparse, nested and quantized tensors, meta
tensors (no data) and expanded views (one stored value for many elements) as readily as dense ones, but a resume
copies every saved value into the live (dense) tensors, and the readers refuse such a file by the kind of its
tensors (:mod:`~dist_resume._core.tensor_kind`): a folder's choice skips it, ``resume`` refuses it. Saving one
would write a checkpoint that only looks like one, found out at the restart, when it is needed. So every save entry
(``save_checkpoint``, ``save_checkpoint_async``, and ``CheckpointManager.save``, ``save_async`` and ``snapshot``)
calls :func:`check_saveable` first, on every rank, before any collective call: the same
:class:`~dist_resume.errors.UsageError` everywhere, nothing written. A step or epoch outside what the readers take
(negative, past int64) is refused there too.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._checkpoint.objects import LiveObjects
from .._core.bounds import count_problem
from .._core.errors import UsageError
from .._core.tensor_kind import odd_tensors
from .._core.text import described, preview

__all__ = ["check_count", "check_saveable"]


def check_count(name: str, value: Any, why: str = "") -> None:
    """Raise :class:`UsageError` (a ``ValueError``) when ``value`` (a step, an epoch) is an int outside 0 to 2**63-1,
    what every reader refuses; ``why`` adds why it must be one (``" (it names the file)"``). Local."""
    if type(value) is int and count_problem(value) is not None:
        raise UsageError(f"{name} must be a non-negative int up to 2**63-1{why}, got {described(value, 40)}")


def _states(objects: LiveObjects, extra: Any) -> dict[str, Any]:
    """Every state a save of ``objects`` writes, by the name the checkpoint keeps it under."""
    states: dict[str, Any] = {"model": objects.model.state_dict(), "extra": extra}
    for name in ("optimizer", "scheduler", "scaler", "ema"):
        obj = getattr(objects, name)
        if obj is not None:
            states[name] = obj.state_dict()
    if isinstance(objects.data, Mapping):  # a position given as a state dict (a loader's own is built by the save)
        states["sampler"] = objects.data
    return states


def check_saveable(objects: LiveObjects, *, step: Any, epoch: Any, extra: Any, where: str) -> None:
    """Raise :class:`UsageError` when a save of ``objects`` would write a checkpoint the readers refuse: a tensor that
    is not dense (sparse, nested, quantized, meta, expanded) in any state it writes, ``extra`` included, or a ``step``
    or ``epoch`` outside 0 to 2**63-1. Local (call it on every rank, before the save's first collective call); reads
    no tensor element.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> model.register_buffer("mask", torch.eye(2).to_sparse())
        >>> check_saveable(LiveObjects(model), step=1, epoch=None, extra=None, where="save_checkpoint")
        Traceback (most recent call last):
        ...
        dist_resume.errors.UsageError: save_checkpoint: the state to save holds tensors that are not dense ...
    """
    check_count("step", step)
    check_count("epoch", epoch)
    odd = odd_tensors(_states(objects, extra), stand_ins=False)
    if odd:
        raise UsageError(
            f"{where}: the state to save holds tensors that are not dense ({preview(odd, quote=False, count=True)}); "
            "a resume copies every saved value into the live dense tensors and refuses a checkpoint holding such "
            "tensors, so nothing was written",
            hint="make them dense (.to_dense(), .contiguous(), a real device instead of meta), keep them out of the "
            "state_dict (register_buffer(..., persistent=False)), or save them yourself with torch.save",
        )
