"""Restoring from a source decided already: read it, plan the restore (validate everything), apply it, and say what was
restored (:class:`ResumeResult`, one INFO line); a folder's checkpoint found damaged as it is read falls back to the
previous one. The calls that decide the source first: :func:`~.resume.resume` and ``CheckpointManager.resume``."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

from .._core.errors import PartialRestoreError, RestoreError, UsageError
from .._core.location import Location
from .._core.log import log_rank0, shown_path
from .._dist.agree import agree_across_ranks
from .._dist.ddp_buckets import replay_layout
from .._dist.env import is_distributed
from .._layout.kinds import CONVENTIONAL
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .._layout.meta import bucket_layout
from .._source.read import SourceContents, read_source
from .._source.source import Source, SourceKind
from .._state.devices import check_first_step
from .._state.prefix import model_key_map
from .apply.transaction import Stage
from .fallback import restore_newest
from .objects import LiveObjects
from .options import ResumeOptions
from .plan.restore_plan import RestorePlan, check_has_data, plan_restore
from .ranged import apply_ranged
from .received import NOTHING, restore_broadcast
from .sharded_restore import is_sharded_restore, restore_sharded
from .striped import apply_striped, check_share, stripes

__all__ = ["ResumeResult", "checked_options", "restore_from"]


@dataclass(frozen=True)
class ResumeResult:
    """What :func:`resume` found and restored.

    ``step`` is the number of optimizer steps completed when the checkpoint was saved, so a resumed loop
    continues at ``step`` (``for step in range(result.step, total)``); ``epoch`` is what was saved.
    ``restored`` names each part of which something was applied; ``skipped`` each part that was passed
    but not restored (absent from the file and allowed to be, or with nothing in it that applied).
    ``applied`` says how much of each part was applied, as ``(applied, total)``: ``applied["model"]`` the
    model keys loaded of ``len(model.state_dict())``, ``applied["optimizer"]`` the parameters whose state
    was restored of the optimizer's parameters, ``applied["ema"]`` the EMA keys loaded of its total; a part
    not passed, or absent from the file, has no entry. ``extra`` holds the file's other entries (e.g. ``args``).
    ``source`` says where the state came from: ``"folder"`` (a ``CheckpointManager`` folder's newest checkpoint),
    ``"memory"`` (a snapshot in the node's shared memory, see :meth:`CheckpointManager.snapshot`) or ``"file"``.
    ``part_keys`` names the key each part came from in a torch file (``{"model": "MODEL_STATE", "epoch":
    "EPOCHS_RUN"}``; ``"state.net"`` one level down): what ``part_keys=`` would pass to choose the same.
    """

    path: Location
    layout: Layout
    step: int | None
    epoch: int | None
    extra: Any
    metadata: dict[str, Any]
    restored: tuple[str, ...]
    skipped: tuple[str, ...] = ()
    missing_keys: list[str] = field(default_factory=list)
    unexpected_keys: list[str] = field(default_factory=list)
    applied: dict[str, tuple[int, int]] = field(default_factory=dict)
    part_keys: dict[str, str] = field(default_factory=dict)
    source: str = "file"


def checked_options(options: Any) -> ResumeOptions:
    """``options``, or the defaults for None; anything but a :class:`ResumeOptions` raises :class:`UsageError`."""
    if options is None:
        return ResumeOptions()
    if not isinstance(options, ResumeOptions):
        raise UsageError(
            f"options= is {type(options).__name__}, not a dist_resume.ResumeOptions",
            hint="pass options=dist_resume.ResumeOptions(strict=False, ...)",
        )
    return options


def restore_from(
    source: Source,
    objects: LiveObjects,
    options: ResumeOptions,
    *,
    started: float | None = None,
    announce: bool = True,
) -> ResumeResult:
    """:func:`_restore_once`; a folder's chosen checkpoint that some rank finds damaged as it reads it (before anything
    changed) is left for the previous complete one, on every rank (:func:`~.fallback.restore_newest`).

    Global rank 0 says what was restored in one INFO line (``resumed from /abs/run/ckpt_00000080.pt at step 80
    (epoch 4) in 0.41 s (restored model, ...)``), the time counted from ``started`` (a ``time.perf_counter()``; this
    call's start when None); ``announce=False`` leaves the line to a caller that says it its own way (``init_from``).
    """
    began = time.perf_counter() if started is None else started
    said = began if announce else None
    return restore_newest(source, lambda chosen: _restore_once(chosen, objects, options, said))


def _restore_once(source: Source, objects: LiveObjects, options: ResumeOptions, began: float | None) -> ResumeResult:
    """Read ``source`` (decided already), validate it against ``objects``, apply it; say what was restored.

    Collective under torch.distributed (every rank validates before anything changes, and after applying every
    rank learns whether every rank applied; if one did not, every rank puts back what it changed and raises; an
    FSDP2 model, :mod:`.sharded_restore`: every rank validates, then fills its shards), local otherwise.
    """
    if is_sharded_restore(objects):  # FSDP2: read, validate everywhere, fill the shards (sharded_restore.py)
        contents, plan, restored = restore_sharded(
            source, objects, options, lambda c: _plan(c, objects, options), agree_applied
        )
    else:
        contents, plan, restored = _restore_whole(source, objects, options)
    parts = plan.parts
    if "optimizer" in restored and objects.optimizer is not None:
        check_first_step(objects.model, objects.optimizer)  # a model.to() after this: named at the first step
    if "model" in restored:  # DDP's first step reduces in the saved run's buckets (collective for a DDP model)
        replay_layout(objects.model, bucket_layout(parts.meta))
    if began is not None:
        log_rank0(logging.INFO, "%s", _resumed_line(contents.path, parts, restored, time.perf_counter() - began))
    return ResumeResult(
        contents.path,
        parts.layout,
        parts.step,
        parts.epoch,
        parts.extra,
        dict(parts.meta),
        restored,
        plan.skipped,
        list(plan.missing_keys),
        list(plan.unexpected_keys),
        dict(plan.applied),
        dict(parts.keys),
        "folder" if source.kind is SourceKind.FOLDER_NEWEST else "file",
    )


def _restore_whole(
    source: Source, objects: LiveObjects, options: ResumeOptions
) -> tuple[SourceContents, RestorePlan, tuple[str, ...]]:
    """Read, validate and apply into a plain, DDP or compiled model (everything but FSDP2)."""
    if source.broadcast:
        return restore_broadcast(source, options, lambda c: _plan(c, objects, options), agree_applied)
    collective = is_distributed()  # a file too: every rank resumes, so every rank learns every rank's outcome
    striped = collective and stripes(source, options)  # a local file every rank sees: each reads its share

    def read_and_plan() -> tuple[SourceContents, RestorePlan]:
        read = read_source(
            source,
            map_location="cpu" if options.map_location is None else options.map_location,
            mmap=options.mmap,
            weights_only=options.weights_only,
            verify=options.verify,
            ranged=True,
            striped=striped,
        )
        try:
            if striped and options.verify and read.ranged is not None:
                check_share(read.ranged)  # this rank's share of the CRC-32s; the agreement below tells every rank
            plan = _plan(read, objects, options)
            if read.ranged is None:  # read with its data: a meta tensor is the file's own, no stand-in
                check_has_data(plan)
        except BaseException:
            if read.ranged is not None:
                read.ranged.close()
            raise
        return read, plan

    contents, plan = _agreed(collective, read_and_plan)
    agree = agree_applied if collective else None
    if striped:  # each rank reads its share of the tensors, the ranks exchange them at the commit
        return contents, plan, apply_striped(contents.ranged, plan, agree_applied)
    if contents.ranged is not None:  # an object on a store: its data read by ranges into the live tensors
        return contents, plan, apply_ranged(contents.ranged, plan, agree)
    return contents, plan, plan.apply(agree=agree)


def _split(obj: Any, source: str, objects: LiveObjects, options: ResumeOptions) -> CheckpointParts:
    """``split_checkpoint`` with what layout detection can use: the entries named by ``part_keys``, the
    model's canonical keys (under ``key_prefix``) to pick the entry that fits, and the parts to restore."""
    model_keys = [(options.key_prefix or "") + k for k in model_key_map(objects.model)]
    wanted = {"model", *objects.passed(), *(("rng",) if options.rng else ())}
    return split_checkpoint(obj, source, model_keys=model_keys, part_keys=options.part_keys, wanted=wanted)


_COUNTERS: Final = {"step": ("global_step",)}  # Lightning's and HF Trainer's name for it
_FOREIGN: Final = (Layout.HF_TRAINER, Layout.ACCELERATE, Layout.DCP, Layout.SAFETENSORS)  # parts named by files


def _resumed_line(path: Location, parts: CheckpointParts, restored: tuple[str, ...], seconds: float) -> str:
    """``resumed from /abs/run/ckpt_00000080.pt at step 80 (epoch 4) in 0.41 s (restored model, optimizer)``; another
    layout than dist_resume's, or parts under other keys, named after the path (``(lightning layout)``)."""
    keys = _key_sources(parts)
    layout = "" if parts.layout is Layout.TOOLKIT and not keys else f" ({parts.layout.value} layout{keys})"
    at = "" if parts.step is None else f" at step {parts.step}"
    epoch = "" if parts.epoch is None else f" (epoch {parts.epoch})"
    what = f"restored {', '.join(restored)}" if restored else "nothing restored"
    return f"resumed from {shown_path(path)}{layout}{at}{epoch} in {seconds:.2f} s ({what})"


def _key_sources(parts: CheckpointParts) -> str:
    """``"; model <- 'MODEL_STATE', ..."`` when some part of a torch file came from a key not named for it.

    A known layout under its own names (``model``, ``optimizer``, ``epoch``) says nothing; one part
    under another name (``{"model", "opt", "Epoch"}``) and every detected layout name them all.
    """
    if parts.layout in _FOREIGN or not parts.keys:
        return ""
    named = all(
        key in (part, *CONVENTIONAL.get(part, ()), *_COUNTERS.get(part, ())) for part, key in parts.keys.items()
    )
    return "" if named and parts.layout is not Layout.DETECTED else f"; {parts.describe_keys()}"


def _plan(contents: SourceContents, objects: LiveObjects, options: ResumeOptions) -> RestorePlan:
    """Validate ``contents`` against the live objects (local; changes nothing)."""
    source = f"checkpoint {str(contents.path)!r}"
    parts = contents.parts if contents.parts is not None else _split(contents.obj, source, objects, options)
    return plan_restore(parts, objects, options, source=source, mmapped=contents.mmapped)


T = TypeVar("T")


def _agreed(collective: bool, fn: Callable[[], T]) -> T:
    """``fn()``; where ``collective``, every rank learns every rank's outcome and raises if any rank failed, before
    anything changes."""
    try:
        result = fn()
    except Exception as err:
        if collective:
            agree_across_ranks(err, what=NOTHING)
        raise
    if collective:
        agree_across_ranks(None, what=NOTHING)
    return result


def agree_applied(error: BaseException | None, stage: Stage) -> None:
    """Apply's agreements (after its steps: all put back if one rank failed; after its commit: all raise
    :class:`PartialRestoreError` if one rank's commit failed). Collective."""
    agree_across_ranks(error, what=stage.value, fallback=PartialRestoreError if stage is Stage.COMMIT else RestoreError)
