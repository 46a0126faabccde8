"""How a run starts from a checkpoint folder: its newest checkpoint, another run's checkpoint, or fresh.

:meth:`CheckpointManager.resume` is the public face; this module holds its decision and the
``init_from`` restore, so that ``folder.py`` stays free of ``restore``'s imports.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .._checkpoint.options import OptimizerHparams, allowed_missing
from .._checkpoint.restore import ResumeResult, resume
from .._core.errors import CheckpointConsensusError, CheckpointError, CheckpointNotFoundError, NotACheckpointError
from .._core.log import log_rank0
from .._core.types import PathLike
from .._dist.comm import all_gather_objects, run_on_rank0
from .._dist.env import is_distributed
from .._foreign.folders import checkpoint_subfolders, foreign_kind, unrecognised_folder
from .._source.listing import numbered_checkpoints

__all__ = ["FolderState", "folder_state", "start_run"]

# resume() options that belong to the run being resumed, never to another run's checkpoint
_OWN_RUN_ONLY = ("scheduler", "scaler", "sampler", "rng")


class FolderState(enum.Enum):
    """What rank 0 finds in a checkpoint folder."""

    HOLDS_CHECKPOINTS = "holds checkpoints"  # files named ckpt_<step>.pt, valid or not
    NONE_YET = "none yet"  # no such file, or no folder yet under an existing parent


def folder_state(folder: Path) -> FolderState:
    """Whether ``folder`` holds files named like checkpoints. Local (rank 0 calls it for everyone).

    A missing folder whose parent exists is a first run (the manager creates it at its first save);
    a missing parent is a mistyped path and raises :class:`CheckpointNotFoundError`.
    """
    if not folder.exists():
        parent = folder.absolute().parent
        if not parent.is_dir():
            raise CheckpointNotFoundError(
                f"checkpoint folder {str(folder)!r} does not exist, and neither does its parent {str(parent)!r}: "
                "a mistyped path would quietly start from step 0, so this is an error; create the parent "
                "folder for a first run, or fix the path"
            )
        return FolderState.NONE_YET
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint folder {str(folder)!r} is a file, not a folder; pass the folder a CheckpointManager "
            "saves into (to resume from a single file use dist_resume.resume(path, ...))"
        )
    if numbered_checkpoints(folder):
        return FolderState.HOLDS_CHECKPOINTS
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
    return FolderState.NONE_YET
    if not folder.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint folder {str(folder)!r} is a file, not a folder; pass the folder a CheckpointManager "
            "saves into (to resume from a single file use dist_resume.resume(path, ...))"
        )
    if numbered_checkpoints(folder):
        return FolderState.HOLDS_CHECKPOINTS
    if foreign_kind(folder) is not None or checkpoint_subfolders(folder):
        # an HF/Accelerate/DCP checkpoint, or the parent of some: starting fresh here would drop that run
        raise NotACheckpointError(
            f"checkpoint folder {str(folder)!r} holds no ckpt_<step>.pt but "
            + ("is itself a foreign checkpoint" if foreign_kind(folder) else "holds checkpoint folders one level down")
            + f" ({unrecognised_folder(folder) if not foreign_kind(folder) else foreign_kind(folder).value}); "  # type: ignore[union-attr]
            "a CheckpointManager saves into a folder of its own: pass that checkpoint as init_from= and a new folder"
        )
    return FolderState.NONE_YET


def _every_rank_sees(path: Path, what: str) -> None:
    """Raise on every rank when some rank does not see ``path``. Collective under torch.distributed."""
    if not is_distributed():
        return
    seen: list[bool] = all_gather_objects(path.exists())
    missing = [rank for rank, ok in enumerate(seen) if not ok]
    if missing:
        raise CheckpointConsensusError(
            f"ranks {missing} do not see {what} {str(path)!r}, which rank 0 sees; every rank must see it: use a "
            "shared filesystem or copy it to every node, or pass broadcast_from_rank0=True",
            ranks=missing,
        )


def _check_options(options: dict[str, Any]) -> None:
    """Raise now for keywords ``resume`` would refuse (unknown names, bad ``allow_missing`` / ``optimizer_hparams``)."""
    try:
        inspect.signature(resume).bind_partial("path", model=None, **options)
    except TypeError as err:
        raise TypeError(f"CheckpointManager.resume(): {err} (the keywords resume() takes are passed through)") from None
    allowed_missing(options.get("allow_missing", ()))
    OptimizerHparams.parse(options.get("optimizer_hparams", "checkpoint"))


def start_run(
    folder: Path,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    init_from: PathLike | None,
    options: dict[str, Any],
) -> ResumeResult | None:
    """The body of :meth:`CheckpointManager.resume` (see there). Collective under torch.distributed."""
    _check_options(options)  # a typo must fail on the first run, not on the first restart after a preemption
    state: FolderState = run_on_rank0(lambda: folder_state(folder), fallback=CheckpointError)
    broadcast = bool(options.get("broadcast_from_rank0"))
    if state is FolderState.HOLDS_CHECKPOINTS:
        if not broadcast:  # resume() reads a folder only where the path is one
            _every_rank_sees(folder, "the checkpoint folder")
        return resume(folder, model=model, optimizer=optimizer, **options)
    if init_from is None:
        log_rank0(logging.INFO, "no checkpoint in %s: starting fresh", folder)
        return None
    source = Path(init_from)
    exists: bool = run_on_rank0(source.exists, fallback=CheckpointError)
    if not exists:
        raise CheckpointNotFoundError(
            f"init_from {str(source)!r} does not exist (seen from rank 0), and checkpoint folder {str(folder)!r} "
            "holds no checkpoint: fix the path, or pass init_from=None to start from scratch"
        )
    if not broadcast:
        _every_rank_sees(source, "init_from")
    return _init(source, model=model, optimizer=optimizer, options=options)


def _init(
    source: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None, options: dict[str, Any]
) -> ResumeResult:
    """Model and optimizer state from another run; the live optimizer keeps its own hyperparameters."""
    loaded = {k: v for k, v in options.items() if k not in _OWN_RUN_ONLY}
    loaded["optimizer_hparams"] = "current"  # this run's lr, betas, weight_decay, initial_lr...
    result = resume(source, model=model, optimizer=optimizer, **loaded)
    log_rank0(
        logging.INFO,
        "initialised %s from %s (step %s of that run); this run starts at step 0",
        " and ".join(result.restored),
        result.path,
        result.step,
    )
    return dataclasses.replace(result, step=0, epoch=0)
