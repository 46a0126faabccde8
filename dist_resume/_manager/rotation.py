"""After a save into a checkpoint folder: temporary files of interrupted saves removed, old checkpoints rotated out.

Both run on the writing rank only, under the folder's lock (:mod:`~dist_resume._manager.lock`),
and both only log what they cannot delete: a file left behind never fails a save that succeeded.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .._core.log import log_rank0, logger
from .._format.atomic import TEMP_NAME
from .._source.listing import CHECKPOINT_NAME, numbered_checkpoints

__all__ = ["remove_leftovers", "rotate_out"]


def remove_leftovers(folder: Path, names: list[str]) -> None:
    """Delete, among ``names`` in ``folder``, the temporary files of interrupted checkpoint saves
    (``.ckpt_<step>.pt.<16 hex>.tmp``); nothing else is touched."""
    for name in names:
        found = TEMP_NAME.match(name)
        if found and CHECKPOINT_NAME.match(found.group("dest")):
            try:
                (folder / name).unlink()
                log_rank0(logging.INFO, "removed %s, left by an interrupted save", folder / name)
            except OSError as err:
                logger.warning("could not remove %s, left by an interrupted save: %s", name, err)


def rotate_out(folder: Path, new: Path, step: int, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints of ``folder``, never ``new`` (just written
    for ``step``); warn when the folder already holds later steps, which latest() would pick."""
    numbered = numbered_checkpoints(folder)
    later = [path.name for s, path in numbered if s > step]
    if later:
        logger.warning(
            "saved step %d into %s, which already holds later steps %s: latest() and resume() "
            "will pick those; delete them if that run was abandoned",
            step,
            folder,
            later,
        )
    keep = {path for _, path in numbered[-keep_last:]} | {new}
    for _, path in numbered:
        if path in keep:
            continue
        try:
            path.unlink()
            log_rank0(logging.INFO, "rotated out %s (keep_last=%d)", path, keep_last)
        except FileNotFoundError:
            pass
        except OSError as err:
            logger.warning("could not delete old checkpoint %s: %s", path, err)
