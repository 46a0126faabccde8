"""A new run started from another run's checkpoint (``CheckpointManager.resume(init_from=...)`` in a folder that holds
none): its model, and its optimizer and EMA state where it holds them, this run's hyperparameters and the rest kept."""

from __future__ import annotations

import dataclasses
import logging
from typing import Final

from .._checkpoint.objects import LiveObjects
from .._checkpoint.options import OptimizerHparams, ResumeOptions
from .._checkpoint.restore import ResumeResult, restore_from
from .._core.errors import CheckpointConsensusError, CheckpointError, CheckpointNotFoundError, NotACheckpointError
from .._core.location import Location
from .._core.log import log_rank0, shown_path
from .._core.text import preview
from .._dist.comm import all_gather_objects, run_on_rank0
from .._dist.env import is_distributed
from .._foreign.folders import checkpoint_subfolders, foreign_kind, unrecognised_folder
from .._format.sniff import CHECKPOINT_SUFFIXES
from .._source.consensus import resolve_source
from .._source.listing import numbered_checkpoints
from .._source.source import Source

__all__ = ["loose_checkpoints", "start_from"]

# what an init_from file may lack: a weights-only file (the usual fine-tune start) initialises the model alone
_INIT_OPTIONAL: Final = ("optimizer", "ema")


def start_from(
    other: Location, folder: Location, objects: LiveObjects, options: ResumeOptions, *, broadcast: bool
) -> ResumeResult:
    """Initialise ``objects`` from ``other`` (see the module): rank 0 checks it (and says what to pass instead), every
    rank confirms it sees it (unless only rank 0 reads), then the restore. Collective under torch.distributed."""
    run_on_rank0(lambda: _check_init_from(other, folder), fallback=CheckpointError)
    if not broadcast:
        _every_rank_sees(other, "init_from")
    return _init(resolve_source(other, broadcast=broadcast), objects, options)


def loose_checkpoints(folder: Location) -> list[Location]:
    """The files in ``folder`` named like checkpoints that a ``CheckpointManager`` does not read (``ckpt.pt``)."""
    try:
        return sorted(
            entry
            for entry in folder.iterdir()
            if entry.suffix in CHECKPOINT_SUFFIXES and not entry.name.startswith(".")
        )
    except OSError:
        return []


def _every_rank_sees(path: Location, what: str) -> None:
    """Raise on every rank when some rank does not see ``path``. Collective under torch.distributed."""
    if not is_distributed():
        return
    seen: list[bool] = all_gather_objects(path.exists())
    missing = [rank for rank, ok in enumerate(seen) if not ok]
    if missing:
        raise CheckpointConsensusError(
            f"ranks {missing} do not see {what} {str(path)!r}, which rank 0 sees; every rank must see it: use a "
            "shared filesystem or copy it to every node, or pass ResumeOptions(broadcast_from_rank0=True)",
            ranks=missing,
        )


def _check_init_from(other: Location, folder: Location) -> None:
    """Refuse an ``init_from`` that does not exist, or a folder that holds no checkpoint ``init_from`` reads, with
    advice for ``init_from`` (rank 0 looks for everyone)."""
    if not other.exists():
        raise CheckpointNotFoundError(
            f"init_from {str(other)!r} does not exist (seen from rank 0), and checkpoint folder {str(folder)!r} "
            "holds no checkpoint: fix the path, or pass init_from=None to start from scratch"
        )
    if not other.is_dir() or numbered_checkpoints(other) or foreign_kind(other) is not None:
        return
    if checkpoint_subfolders(other):
        raise unrecognised_folder(other)
    loose = loose_checkpoints(other)
    if loose:
        raise NotACheckpointError(
            f"init_from {str(other)!r} is a folder with no ckpt_<step>.pt, holding {preview((str(p) for p in loose), 4)}: "
            f"pass the file itself, init_from={str(loose[-1])!r}"
        )
    found = sorted(p.name for p in other.iterdir())
    raise CheckpointNotFoundError(
        f"init_from {str(other)!r} is a folder with no checkpoint in it ("
        + (f"it holds {preview(found, 8)}" if found else "it is empty")
        + "): pass a checkpoint file or folder, or init_from=None to start from scratch"
    )


def _init(source: Source, objects: LiveObjects, options: ResumeOptions) -> ResumeResult:
    """Another run's model, and its optimizer (and EMA) state where its file holds them: a new run, which keeps
    this run's group hyperparameters, scheduler, scaler, data position and RNG streams."""
    only = LiveObjects(objects.model, objects.optimizer, ema=objects.ema)
    init_options = dataclasses.replace(
        options,
        optimizer_hparams=OptimizerHparams.CURRENT,  # this run's lr, betas, weight_decay, initial_lr...
        rng=False,
        allow_missing=frozenset(options.allow_missing).union(_INIT_OPTIONAL),
    )
    result = restore_from(source, only, init_options, announce=False)
    absent = [part for part in _INIT_OPTIONAL if part in result.skipped]
    log_rank0(
        logging.INFO,
        "initialised %s from %s (step %s of that run); this run starts at step 0%s",
        " and ".join(result.restored),
        shown_path(result.path),
        result.step,
        f"; that file holds no {' or '.join(absent)} state: left as built" if absent else "",
    )
    return dataclasses.replace(result, step=0, epoch=0)
