"""``resume()``: the live objects named once, the options checked, the user's path made a ``Location`` and its source
resolved once (a file, a folder's newest checkpoint, a foreign source, a broadcast), then :func:`~.restore.restore_from`.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

from .._core.types import PathLike
from .._dist.checkin import check_in
from .._exact.data import stateful_data
from .._source.consensus import resolve_source
from .._store.url import location
from .moved import refuses_moved_keywords
from .objects import LiveObjects
from .options import ResumeOptions
from .restore import ResumeResult, checked_options, restore_from

__all__ = ["resume"]


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
