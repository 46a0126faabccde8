"""What a checkpoint folder holds: ``ckpt_<step>.pt`` and ``ckpt_<step>.dcp/`` names, and the newest checkpoint
that is complete and intact.

A checkpoint in a folder is a file ``ckpt_<step, 8 digits>.pt`` or a sharded checkpoint folder
``ckpt_<step, 8 digits>.dcp/`` (what an FSDP2 model saves by default). It counts only once it is complete:
the name appears only through a rename after the data is fsynced (:func:`~dist_resume._format.atomic.atomic_write`
for a file, :func:`~dist_resume._save.sharded.save_sharded` for a folder), and it must pass
:func:`~dist_resume._source.integrity.inspect_checkpoint` (a file: zip structure, the CRC-32 of every record,
dist_resume metadata whose step matches the name; a folder: its manifest, every file's size and CRC-32, the
step). Readers need no lock (see :mod:`~dist_resume._manager.lock` for the writer's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from .._core.errors import CheckpointError, NotACheckpointError
from .._core.log import logger
from .._core.types import PathLike
from .integrity import CheckpointInfo, inspect_checkpoint

__all__ = [
    "CHECKPOINT_NAME",
    "checkpoint_name",
    "sharded_checkpoint_name",
    "numbered_checkpoints",
    "check_numbered",
    "first_valid",
    "find_latest",
    "latest_checkpoint",
]

CHECKPOINT_NAME: Final = re.compile(r"^ckpt_(\d+)\.(pt|dcp)$")


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step`` in a checkpoint folder: ``ckpt_00000100.pt``."""
    return f"ckpt_{step:08d}.pt"


def sharded_checkpoint_name(step: int) -> str:
    """The name of the sharded checkpoint folder of ``step`` in a checkpoint folder: ``ckpt_00000100.dcp``."""
    return f"ckpt_{step:08d}.dcp"


def numbered_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every entry named like a checkpoint (``ckpt_<step>.pt``, ``ckpt_<step>.dcp``), oldest
    first (for one step, the folder before the file); [] for a missing folder."""
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CheckpointError(
            f"cannot list checkpoint folder {str(folder)!r}: {err.strerror or err}; check that it is a readable folder"
        ) from err
    found = [(int(m.group(1)), folder / name) for name in names if (m := CHECKPOINT_NAME.match(name))]
    return sorted(found)


def check_numbered(path: Path, step: int, verify: bool) -> CheckpointInfo:
    """``path``'s :class:`CheckpointInfo` if it is a complete checkpoint of ``step`` (its name's), else raise
    :class:`CheckpointError` (``verify``: every record's CRC-32 too)."""
    info = inspect_checkpoint(path, verify=verify)
    if info.step != step:
        raise NotACheckpointError(
            f"{str(path)!r} is named for step {step} but its metadata says step "
            f"{info.step}; it was renamed or copied by hand: rename it to "
            f"{(sharded_checkpoint_name if path.suffix == '.dcp' else checkpoint_name)(info.step or 0)!r} or remove it"
        )
    return info


def first_valid(
    candidates: Iterable[tuple[int, Path]], verify: bool
) -> tuple[CheckpointInfo | None, list[tuple[Path, Exception]]]:
    """The first of ``candidates`` ((step, path), newest first) that is complete, and those skipped before it, each
    with its error. Local; logs nothing (:func:`find_latest` does)."""
    skipped: list[tuple[Path, Exception]] = []
    for step, path in candidates:
        try:
            return check_numbered(path, step, verify), skipped
        except (CheckpointError, OSError) as err:
            skipped.append((path, err))
    return None, skipped


def find_latest(
    folder: Path, verify: bool, numbered: list[tuple[int, Path]] | None = None
) -> tuple[CheckpointInfo | None, list[tuple[Path, Exception]]]:
    """The newest complete checkpoint, and the newer ones skipped on the way, each with its error (logged).

    ``numbered`` is the folder's :func:`numbered_checkpoints` when the caller has listed it already."""
    info, skipped = first_valid(reversed(numbered_checkpoints(folder) if numbered is None else numbered), verify)
    for path, err in skipped:
        logger.warning("skipping checkpoint %s: %s", path, err)
    return info, skipped


def latest_checkpoint(folder: PathLike, *, verify: bool = True) -> Path | None:
    """The newest complete checkpoint in ``folder``, or None when there is none (or no folder).

    Local. Newer checkpoints that fail the check are skipped, each logged (logger ``dist_resume``,
    WARNING) with the reason. ``verify=True`` checks the CRC-32 of every record (reads each
    candidate once); ``verify=False`` checks the zip structure and metadata only (a sharded
    checkpoint folder: its manifest and every file's size). Temporary files and folders of
    interrupted saves never count. Under torch.distributed use :func:`resume` (or
    :func:`resolve_checkpoint`) with the folder instead, so that every rank agrees.

    Example::

        >>> mgr = dist_resume.CheckpointManager("ckpts", keep_last=2)
        >>> mgr.save(100, model=torch.nn.Linear(2, 2))
        PosixPath('ckpts/ckpt_00000100.pt')
        >>> dist_resume.tools.latest_checkpoint("ckpts")
        PosixPath('ckpts/ckpt_00000100.pt')
    """
    info, _ = find_latest(Path(folder), verify)
    return None if info is None else info.path
