"""Where another run continues once ``convert --into`` brought its checkpoint into a folder: the step and the epoch at
which its own resume would continue (:func:`resume_point`), each said with the field it came from.

A dist_resume checkpoint's ``epoch`` is the epoch the loop continues in; other tools record other things:

| source | step | epoch the next run continues in |
|---|---|---|
| dist_resume | ``meta.step`` | ``meta.epoch`` |
| Lightning ``.ckpt`` | ``global_step`` | its fit loop's ``epoch_progress.current.processed`` (one more when the save came at that epoch's last batch, which Lightning then counts as processed); without ``loops``, ``epoch`` |
| HF Trainer ``checkpoint-N/`` | ``trainer_state.json`` ``global_step`` | the whole epochs of its fractional ``epoch`` (HF continues in ``global_step // steps per epoch``) |
| nanoGPT ``ckpt.pt`` | ``iter_num`` | none |
| torchvision / timm references | none | ``epoch + 1``: ``epoch`` is the one just finished, their ``--resume`` continues at the next (timm's files before ``version`` 2: ``epoch``) |
| Accelerate ``save_state`` folder | ``step_N`` in its name | ``epoch_N`` in its name: ``N + 1`` (the folder names and resume of Accelerate's examples) |
| any other | its step key (``step``, ``iter_num``, ...) | its epoch key, as recorded |

A source that records an epoch but no step continues at step ``epochs finished × steps_per_epoch`` when that is given,
else at step 0 with its epoch set; one that records neither is refused (the step names the file).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .._core.errors import UsageError
from .._core.location import Location
from .._core.text import preview
from .._layout.layout import CheckpointParts, Layout
from .._state.optim.keys import digit_id

__all__ = ["ResumePoint", "resume_point"]

_STEP_FROM: Final = {
    Layout.TOOLKIT: "meta 'step'",
    Layout.SHARDED: "meta 'step'",
    Layout.HF_TRAINER: "trainer_state.json 'global_step'",
    Layout.SAFETENSORS: "__metadata__ 'step'",
}
_ACCELERATE_NAME: Final = re.compile(r"^(epoch|step)_(\d+)$")  # Accelerate's examples: output_dir/epoch_3, step_500


@dataclass(frozen=True)
class ResumePoint:
    """The step and epoch a converted checkpoint continues at, and where each came from (``epoch_from`` None when no
    epoch is known)."""

    step: int
    step_from: str
    epoch: int | None
    epoch_from: str | None

    def said(self) -> str:
        """In words: ``step 250 (from key 'iter_num'), epoch 5 (from key 'epoch' 4 + 1: ...)``."""
        epoch = f", epoch {self.epoch} (from {self.epoch_from})" if self.epoch is not None else ", no epoch recorded"
        return f"step {self.step} (from {self.step_from}){epoch}"


def _whole(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _lightning_epoch(parts: CheckpointParts) -> tuple[int, str] | None:
    """The epoch Lightning's fit loop continues in, from the ``loops`` state it saved (FACTS 18)."""
    loops = parts.extra.get("loops") if isinstance(parts.extra, Mapping) else None
    fit = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    progress = fit.get("epoch_progress") if isinstance(fit, Mapping) else None
    current = progress.get("current") if isinstance(progress, Mapping) else None
    processed = _whole(current.get("processed")) if isinstance(current, Mapping) else None
    if processed is None or not isinstance(current, Mapping):
        return None
    batches = fit.get("epoch_loop.batch_progress") if isinstance(fit, Mapping) else None
    last = isinstance(batches, Mapping) and batches.get("is_last_batch") is True
    if last and current.get("completed") == processed:  # saved at the epoch's last batch: Lightning moves on
        return processed + 1, f"Lightning's fit loop: epoch {processed} processed up to its last batch"
    return processed, "Lightning's fit loop: epoch_progress processed"


def _finished_epoch(parts: CheckpointParts) -> tuple[int, str] | None:
    """torchvision's and timm's ``epoch``: the epoch just finished (their ``args`` beside it; timm's ``version``)."""
    extra = parts.extra if isinstance(parts.extra, Mapping) else {}
    if parts.keys.get("epoch") != "epoch" or parts.epoch is None or ("args" not in extra and "version" not in extra):
        return None
    version = extra.get("version")
    if type(version) is int and version < 2:  # timm before version 2 saved the epoch to continue at
        return None
    who = "timm" if "version" in extra else "torchvision"
    return parts.epoch + 1, f"key 'epoch' {parts.epoch} + 1: {who}'s epoch is the one it finished"


def _accelerate(src: Location) -> tuple[str, int] | None:
    found = _ACCELERATE_NAME.match(src.name)
    return (found.group(1), int(found.group(2))) if found else None


def _epoch_of(parts: CheckpointParts, src: Location) -> tuple[int | None, str | None]:
    if parts.layout is Layout.LIGHTNING and (lightning := _lightning_epoch(parts)) is not None:
        return lightning
    if parts.layout is Layout.ACCELERATE:
        named = _accelerate(src)
        if named is not None and named[0] == "epoch":
            return named[1] + 1, f"folder name {src.name!r}: Accelerate's examples resume after the epoch it names"
        return None, None
    finished = _finished_epoch(parts)
    if finished is not None:
        return finished
    if parts.epoch is None:
        return None, None
    if parts.layout is Layout.HF_TRAINER:
        fraction = parts.meta.get("epoch_float")
        return parts.epoch, f"trainer_state.json 'epoch' {fraction}: the whole epochs done, where HF's resume continues"
    key = parts.keys.get("epoch")
    return parts.epoch, f"key {key!r}" if key else "meta 'epoch'"


def _recorded_step(parts: CheckpointParts, src: Location) -> tuple[int | None, str]:
    where = f"key {parts.keys['step']!r}" if "step" in parts.keys else _STEP_FROM.get(parts.layout, "its metadata")
    found = parts.step
    if found is None and parts.layout is Layout.SAFETENSORS:
        found = digit_id(parts.meta.get("safetensors_metadata", {}).get("step", ""))
    if found is None and parts.layout is Layout.ACCELERATE and (named := _accelerate(src)) and named[0] == "step":
        found, where = named[1], f"folder name {src.name!r}"
    return found, where


def resume_point(
    parts: CheckpointParts, src: Location, *, step: int | None = None, steps_per_epoch: int | None = None
) -> ResumePoint:
    """Where ``parts`` (read from ``src``) continues: ``step`` when given, else the one it records, else from its
    epoch (``steps_per_epoch``); the epoch its own resume would continue in. Raises :class:`UsageError` for a
    source that records neither a step nor an epoch, or a negative step. Local."""
    epoch, epoch_from = _epoch_of(parts, src)
    if step is not None:
        return ResumePoint(step, "--step", epoch, epoch_from)
    found, where = _recorded_step(parts, src)
    if found is None and epoch is not None:
        if steps_per_epoch is None:
            said = "the epoch: no step recorded, so 0 (--steps-per-epoch K: the epochs before it x K)"
            return ResumePoint(0, said, epoch, epoch_from)
        said = f"the epoch: no step recorded, so {epoch} epochs x --steps-per-epoch {steps_per_epoch}"
        return ResumePoint(epoch * steps_per_epoch, said, epoch, epoch_from)
    if found is None:
        keys = sorted(str(k) for k in parts.keys.values())
        raise UsageError(
            f"{str(src)!r} ({parts.layout.value}) records no step (no meta.step, global_step, iter_num, step, ... "
            f"{'; its parts came from ' + preview(keys, 6) if keys else ''}) and no epoch, and the checkpoint's file "
            "name in the folder is its step",
            "pass the step the run reached with --step N (convert_into_folder(..., step=N))",
        )
    if found < 0:
        raise UsageError(
            f"{str(src)!r} records step {found} (from {where}), and a checkpoint's step is not negative",
            "pass the step the run reached with --step N",
        )
    return ResumePoint(found, where, epoch, epoch_from)
