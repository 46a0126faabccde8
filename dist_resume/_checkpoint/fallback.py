"""A folder's chosen checkpoint found damaged only as it is read: every rank falls back to the previous complete one.

The choice of a ``CheckpointManager`` folder's newest checkpoint (:func:`~dist_resume._source.consensus.choose_newest`)
skips every checkpoint its checks find damaged. What only reading finds (a stored tensor that is not what
``.metadata`` declares, where the choice could not tell; a record torch refuses) raises
:class:`~dist_resume.errors.CheckpointCorruptError` while the checkpoint is read and validated, before anything
changed: apply raises :class:`~dist_resume.errors.RestoreError` for every failure once something may have changed.
:func:`restore_newest` then does what the choice does for a damaged checkpoint: every rank learns whether some rank
found the checkpoint damaged (one all-gather, so every rank takes the same branch), rank 0 chooses the newest complete
checkpoint older than those that failed, every rank confirms it sees it, and that one is restored.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from .._core.errors import CheckpointCorruptError, CheckpointError, DistResumeError
from .._core.location import Location
from .._core.log import log_rank0, logger
from .._core.text import preview
from .._dist.agree import gather_agreed
from .._dist.comm import run_on_rank0
from .._dist.env import is_distributed
from .._source.consensus import confirm_choice
from .._source.integrity import CheckpointInfo
from .._source.listing import first_valid, numbered_checkpoints
from .._source.source import Source, SourceKind

__all__ = ["restore_newest"]

T = TypeVar("T")


def _damaged_somewhere(err: Exception) -> bool:
    """Whether some rank's restore failed with :class:`CheckpointCorruptError`. Collective under torch.distributed:
    every rank whose restore of a folder's checkpoint failed calls it (that restore fails on every rank or on none);
    a lost peer answers False, and the caller raises its own error."""
    damaged = isinstance(err, CheckpointCorruptError)
    if not is_distributed():
        return damaged
    try:
        return any(gather_agreed(None, damaged, what="agreeing whether the checkpoint read was damaged"))
    except DistResumeError:
        return False


def _older(folder: Location, failed: list[tuple[Location, Exception]]) -> CheckpointInfo:
    """Rank 0's choice: the newest complete checkpoint of ``folder`` but those that ``failed`` when read."""
    names = {path.name for path, _ in failed}
    candidates = [(step, path) for step, path in numbered_checkpoints(folder) if path.name not in names]
    info, skipped = first_valid(reversed(candidates), verify=True)
    for path, err in skipped:
        logger.warning("skipping checkpoint %s: %s", path, err)
    if info is not None:
        return info
    every = failed + skipped
    reasons = preview((f"{p.name}: {type(e).__name__}" for p, e in every), sep="; ", quote=False)
    raise CheckpointCorruptError(
        f"checkpoint folder {str(folder)!r} holds {len(every)} checkpoint(s) and none is complete and intact "
        f"({reasons}; first: {failed[0][1]}); restore a good checkpoint into it, or pass a checkpoint file to "
        "resume() explicitly"
    )


def restore_newest(source: Source, restore: Callable[[Source], T]) -> T:
    """``restore(source)``; for a folder's chosen checkpoint (``FOLDER_NEWEST``) that some rank finds damaged as it
    reads it, the same for the previous complete checkpoint, and so on. Collective where ``restore`` is."""
    failed: list[tuple[Location, Exception]] = []
    while True:
        try:
            return restore(source)
        except Exception as err:
            if source.kind is not SourceKind.FOLDER_NEWEST or source.folder is None or not _damaged_somewhere(err):
                raise
            failed.append((source.path, err))
            log_rank0(
                logging.WARNING,
                "checkpoint %s is damaged (%s): nothing was restored from it; resuming from the previous complete "
                "checkpoint",
                source.path,
                err,
            )
            source = _previous(source, source.folder, failed)


def _previous(source: Source, folder: Location, failed: list[tuple[Location, Exception]]) -> Source:
    """The source of the checkpoint before those that ``failed``: rank 0 chooses, every rank confirms (unless only
    rank 0 reads). Collective under torch.distributed."""
    chosen: CheckpointInfo = run_on_rank0(
        lambda: _older(folder, failed),
        fallback=CheckpointError,
        task=f"choose the checkpoint before {source.path.name} in {str(folder)!r}",
    )
    path = chosen.path if source.broadcast else confirm_choice(folder, chosen)
    return Source.newest(path, folder, chosen.layout, broadcast=source.broadcast)
