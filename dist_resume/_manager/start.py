"""How a run starts from a checkpoint folder: its newest checkpoint, another run's checkpoint, or fresh.

:meth:`CheckpointManager.resume` is the public face; this module holds its decision and the ``init_from``
restore, so that ``manager.py`` stays free of ``restore``'s imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
from collections.abc import Callable
from typing import Final

from .._checkpoint.objects import LiveObjects
from .._checkpoint.options import OptimizerHparams, ResumeOptions
from .._checkpoint.restore import ResumeResult, restore_from
from .._core.errors import CheckpointConsensusError, CheckpointError, CheckpointNotFoundError, NotACheckpointError
from .._core.location import Location, RemotePath
from .._core.log import log_rank0
from .._core.types import PathLike
from .._dist.comm import all_gather_objects, run_on_rank0
from .._dist.env import is_distributed
from .._foreign.folders import checkpoint_subfolders, foreign_kind, unrecognised_folder
from .._source.consensus import choose_newest, confirm_choice, resolve_source
from .._source.integrity import CheckpointInfo
from .._source.listing import numbered_checkpoints
from .._source.source import Source
from .._store.url import location

__all__ = ["FolderState", "folder_state", "start_run"]

# what an init_from file may lack: a weights-only file (the usual fine-tune start) initialises the model alone
_INIT_OPTIONAL: Final = ("optimizer", "ema")


class FolderState(enum.Enum):
    """What rank 0 finds in a checkpoint folder."""

    HOLDS_CHECKPOINTS = "holds checkpoints"  # files named ckpt_<step>.pt, valid or not
    NONE_YET = "none yet"  # no such file, or no folder yet under an existing parent


def folder_state(folder: Location) -> tuple[FolderState, list[tuple[int, Location]]]:
    """Whether ``folder`` holds files named like checkpoints, and those files (step, path), oldest first.
    Local (rank 0 calls it for everyone).

    A missing folder whose parent exists is a first run (the manager creates it to take its lock);
    a missing parent is a mistyped path and raises :class:`CheckpointNotFoundError`. On an object store a prefix
    with nothing under it is a first run, and a missing bucket the mistyped path.
    """
    if isinstance(folder, RemotePath) and not folder.exists():
        bucket = folder.bucket
        if bucket is not None and not bucket.exists():
            raise CheckpointNotFoundError(
                f"checkpoint folder {str(folder)!r} is in the bucket {str(bucket)!r}, which does not exist (or these "
                "credentials cannot see it): create the bucket for a first run, or fix the URL"
            )
        return FolderState.NONE_YET, []
    if not folder.exists():
        parent = folder.absolute().parent
        if not parent.is_dir():
            raise CheckpointNotFoundError(
                f"checkpoint folder {str(folder)!r} does not exist, and neither does its parent {str(parent)!r}: "
                "a mistyped path would quietly start from step 0, so this is an error; create the parent "
                "folder for a first run, or fix the path"
            )
        _warn_near_miss(folder, parent)
        return FolderState.NONE_YET, []
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint folder {str(folder)!r} is a file, not a folder; pass the folder a CheckpointManager "
            "saves into (to resume from a single file use dist_resume.resume(path, ...))"
        )
    numbered = numbered_checkpoints(folder)
    if numbered:
        return FolderState.HOLDS_CHECKPOINTS, numbered
    kind = foreign_kind(folder)
    if kind is not None or checkpoint_subfolders(folder):  # starting fresh here would drop that run
        what = (
            f"it is itself a checkpoint (layout {kind.value!r})"
            if kind is not None
            else str(unrecognised_folder(folder))
        )
        raise NotACheckpointError(
            f"checkpoint folder {str(folder)!r} holds no ckpt_<step>.pt: {what}; a CheckpointManager saves into a "
            "folder of its own: give it a new folder and pass that checkpoint as init_from="
        )
    return FolderState.NONE_YET, []


def _warn_near_miss(folder: Location, parent: Location) -> None:
    """Say at WARNING (printed even without logging set up) when a folder next to the missing ``folder``, named
    almost like it, holds checkpoints: a mistyped path would otherwise start from step 0 with one INFO line."""
    try:
        names = [entry.name for entry in parent.iterdir() if entry.is_dir() and entry.name != folder.name]
    except OSError:
        return
    for name in difflib.get_close_matches(folder.name, names, n=3, cutoff=0.75):
        numbered = numbered_checkpoints(parent / name)
        if numbered:
            log_rank0(
                logging.WARNING,
                "checkpoint folder %s does not exist, but %s next to it holds checkpoints (newest: %s): if that is "
                "the run to continue, fix the path; starting fresh in %s",
                folder,
                parent / name,
                numbered[-1][1].name,
                folder,
            )
            return


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


def start_run(
    folder: Location,
    objects: LiveObjects,
    options: ResumeOptions,
    *,
    init_from: PathLike | None,
    take_lock: Callable[[], None],
) -> ResumeResult | None:
    """The body of :meth:`CheckpointManager.resume` (see there). Collective under torch.distributed.

    In one step, rank 0 lists the folder, takes its write lock (``take_lock``: a second job on the folder is
    refused here, before it reads a checkpoint or trains) and chooses the newest complete checkpoint; every
    rank then confirms it sees that file, unless only rank 0 reads (``broadcast_from_rank0``).
    """

    def look_lock_choose() -> CheckpointInfo | None:
        state, numbered = folder_state(folder)
        take_lock()
        return choose_newest(folder, numbered) if state is FolderState.HOLDS_CHECKPOINTS else None

    chosen: CheckpointInfo | None = run_on_rank0(
        look_lock_choose, fallback=CheckpointError, task="look at the checkpoint folder"
    )
    broadcast = options.broadcast_from_rank0 and is_distributed()
    if chosen is not None:
        path = chosen.path if broadcast else confirm_choice(folder, chosen)
        source = Source.newest(path, folder, chosen.layout, broadcast=broadcast)
        return restore_from(source, objects, options)
    if init_from is None:
        log_rank0(logging.INFO, "no checkpoint in %s: starting fresh", folder)
        return None
    other = location(init_from)
    exists: bool = run_on_rank0(other.exists, fallback=CheckpointError)
    if not exists:
        raise CheckpointNotFoundError(
            f"init_from {str(other)!r} does not exist (seen from rank 0), and checkpoint folder {str(folder)!r} "
            "holds no checkpoint: fix the path, or pass init_from=None to start from scratch"
        )
    if not broadcast:
        _every_rank_sees(other, "init_from")
    return _init(resolve_source(other, broadcast=broadcast), objects, options)


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
    result = restore_from(source, only, init_options)
    absent = [part for part in _INIT_OPTIONAL if part in result.skipped]
    log_rank0(
        logging.INFO,
        "initialised %s from %s (step %s of that run); this run starts at step 0%s",
        " and ".join(result.restored),
        result.path,
        result.step,
        f"; that file holds no {' or '.join(absent)} state: left as built" if absent else "",
    )
    return dataclasses.replace(result, step=0, epoch=0)
