"""resume(): resolve the source once, read it, plan the restore (validate everything), apply it."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import torch
from torch import nn

from .._core.errors import PartialRestoreError, RestoreError, UsageError
from .._core.location import Location
from .._core.log import log_rank0, shown_path
from .._core.types import PathLike
from .._dist.agree import agree_across_ranks
from .._dist.checkin import check_in
from .._dist.ddp_buckets import replay_layout
from .._dist.env import is_distributed
from .._exact.data import stateful_data
from .._layout.kinds import CONVENTIONAL
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .._layout.meta import bucket_layout
from .._source.consensus import resolve_source
from .._source.read import SourceContents, read_source
from .._source.source import Source, SourceKind
from .._state.devices import check_first_step
from .._state.prefix import model_key_map
from .._store.url import location
from .apply.transaction import Stage
from .fallback import restore_newest
from .moved import refuses_moved_keywords
from .objects import LiveObjects
from .options import ResumeOptions
from .plan.restore_plan import RestorePlan, check_has_data, plan_restore
from .ranged import apply_ranged
from .received import NOTHING, restore_broadcast
from .sharded_restore import is_sharded_restore, restore_sharded
from .striped import apply_striped, check_share, stripes

__all__ = ["ResumeResult", "resume", "checked_options", "restore_from"]


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


@refuses_moved_keywords
def resume(
    path: PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    dataloader: Any = None,
    ema: nn.Module | None = None,
    options: ResumeOptions | None = None,
) -> ResumeResult:
    """Restore model, optimizer, LR scheduler, GradScaler, data position, RNG streams and EMA, all or nothing.

    Collective under torch.distributed (call it on every rank, after wrapping the model in DDP or before,
    either works; a call on some ranks only is named within seconds, see :class:`CheckpointManager`), local in a
    single process: each rank reads the file and restores its own objects.
    ``path`` may also be a checkpoint folder (:class:`CheckpointManager`): rank 0 picks the newest complete
    checkpoint and every rank confirms it sees the same file (see :func:`dist_resume.tools.resolve_checkpoint`).
    How the file is read and what may be missing is
    ``options``, a :class:`ResumeOptions` (validated when it was built; the defaults when None):
    ``strict``, ``allow_missing``, ``optimizer_hparams``, ``rng``, ``key_prefix``, ``part_keys``,
    ``map_location``, ``mmap``, ``weights_only``, ``verify``, ``broadcast_from_rank0``.

    Reads this toolkit's files, a bare state dict, any dict whose parts are recognised by name or
    content (``{"MODEL_STATE", "EPOCHS_RUN"}`` of PyTorch's DDP tutorial, Lightning ``.ckpt``,
    ``{"net", "opt", "it"}``; two candidates for a part it restores are an error naming them, and
    ``part_keys`` chooses), HF Trainer / Accelerate / DCP folders and ``.safetensors`` files (see
    docs/sources.md), with any ``module.``/``_orig_mod.`` prefixes, into a plain or wrapped model
    on any device.

    By default the file is memory-mapped on the CPU and copied into the existing tensors, so no
    rank holds a second full copy on its accelerator. Keys, shapes, dtypes, optimizer groups, parameter
    names and state shapes are validated before anything changes. Applying is all or nothing too: what can
    still fail runs first (the small states, the optimizer's load on its own state tensors, a model whose own
    load has hooks or overrides), and if a part's load fails every part already restored is put back and
    :class:`~dist_resume.errors.RestoreError` names the part, chained to the cause. Then the data is written
    into the live tensors in place, no copy kept; a fault in that copy raises
    :class:`~dist_resume.errors.PartialRestoreError` (resume again to restore the checkpoint whole).
    Afterwards optimizer state sits on its parameters' devices, and the optimizer's first ``step()`` checks
    that it still does (a model moved after the resume is named there, with the fix).

    Across ranks: under torch.distributed (more than one rank) the resume is collective, whatever ``path`` is:
    call it on every rank. The ranks first agree on the kind of source (every rank a checkpoint file, or the same
    ``CheckpointManager`` folder, whose newest checkpoint rank 0 chooses and every rank confirms, or
    ``broadcast_from_rank0``), then after validating, after the steps that can fail and after the commit: a
    failure on any rank makes every rank put back what it changed (or, in the commit, say it holds part of the
    checkpoint) and raise the same error class, relayed with ``rank`` set. No rank resumes alone. To read a
    checkpoint on one rank only, use :func:`load_checkpoint` (local).

    - ``dataloader``: a ``DataLoader`` whose sampler (or ``batch_sampler.sampler``) is a
      :class:`ResumableDistributedSampler`, or that sampler itself (a loop that iterates it): the epoch
      continues at the saved position, split over the ranks present now. A file holding sampler state
      resumed without it restarts the epoch from its first batch, logged at WARNING.
    - ``ema``: an EMA model (``torch.optim.swa_utils.AveragedModel``, ``n_averaged`` included, or any
      ``nn.Module``) restored from the file's EMA entry, its key prefixes adapted like the model's.
    - RNG (``options.rng``, True by default, as on save): each rank restores its own saved streams (python,
      torch CPU, its device, numpy). When the world size changed, ranks missing from the checkpoint derive
      theirs from the saved seed, their rank and the step, and rank 0 logs it at WARNING. A file without
      RNG state leaves the streams as they are: ``"rng"`` is in ``ResumeResult.skipped``, said once at INFO.
    - ``args`` (an ``argparse.Namespace``, as torchvision references and timm save) loads under
      ``weights_only=True`` and comes back in ``ResumeResult.extra``.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        >>> path = dist_resume.save_checkpoint("ckpt.pt", model=model, optimizer=opt, step=7)
        >>> dist_resume.resume(path, model=model, optimizer=opt).step
        7
        >>> opts = dist_resume.ResumeOptions(rng=False, allow_missing=("scheduler",))
        >>> dist_resume.resume(path, model=torch.nn.Linear(2, 2), options=opts).restored
        ('model',)
    """
    started = time.perf_counter()
    opts = checked_options(options)
    objects = LiveObjects(model, optimizer, scheduler, scaler, stateful_data(dataloader, saving=False), ema)
    check_in("dist_resume.resume()")  # a call made on some ranks only is named, not hung
    where = location(path)  # the entry: decided here, passed down as it is
    return restore_from(resolve_source(where, broadcast=opts.broadcast_from_rank0), objects, opts, started=started)


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
