"""What a checkpoint folder holds: ``ckpt_<step>.pt`` and ``ckpt_<step>.dcp/`` names, and the newest checkpoint
that is complete and intact.

A checkpoint in a folder is a file ``ckpt_<step, 8 digits>.pt`` or a sharded checkpoint folder
``ckpt_<step, 8 digits>.dcp/`` (what an FSDP2 model saves by default). It counts only once it is complete:
the name appears only through a rename after the data is fsynced (:func:`~dist_resume._format.atomic.atomic_write`
for a file, :func:`~dist_resume._save.sharded.save_sharded` for a folder), and it must pass
:func:`~dist_resume._source.integrity.inspect_checkpoint` (a file: zip structure, the CRC-32 of every record,
dist_resume metadata whose step matches the name; a folder: its manifest, every file's size and CRC-32, the
step). On an object store an object appears under its name only when its upload completes, and a sharded folder
counts once its manifest, uploaded last, is there. Readers need no lock (see :mod:`~dist_resume._manager.lock` for
the writer's).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Final

from .._core.errors import CheckpointError, NotACheckpointError
from .._core.location import Location, RemotePath
from .._core.log import logger
from .._core.types import PathLike
from .._format.manifest import MANIFEST
from .._store.url import location
from .checked import recall, remember, signature
from .integrity import CheckpointInfo, inspect_checkpoint

__all__ = [
    "CHECKPOINT_NAME",
    "checkpoint_name",
    "sharded_checkpoint_name",
    "numbered_checkpoints",
    "check_numbered",
    "first_valid",
    "find_latest",
    "RELISTS",
    "uncommitted",
    "exists",
    "latest_checkpoint",
]

CHECKPOINT_NAME: Final = re.compile(r"^ckpt_(\d+)\.(pt|dcp)$")
RELISTS: Final = 8  # listings of one folder while a writer races the reader; each save changes it once


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint of ``step`` in a checkpoint folder: ``ckpt_00000100.pt``."""
    return f"ckpt_{step:08d}.pt"


def sharded_checkpoint_name(step: int) -> str:
    """The name of the sharded checkpoint folder of ``step`` in a checkpoint folder: ``ckpt_00000100.dcp``."""
    return f"ckpt_{step:08d}.dcp"


def numbered_checkpoints(folder: Location) -> list[tuple[int, Location]]:
    """(step, path) of every entry named like a checkpoint (``ckpt_<step>.pt``, ``ckpt_<step>.dcp``), oldest
    first (for one step, the folder before the file); [] for a missing folder.

    On an object store, where a sharded folder's files appear under their final names as they are uploaded, a
    ``ckpt_<step>.dcp/`` counts only once its ``manifest.json`` (uploaded last) is there: a save in progress or
    killed is never listed (:func:`uncommitted` lists those)."""
    if isinstance(folder, RemotePath):
        return sorted((s, p) for s, p in _remote_entries(folder) if p.suffix != ".dcp" or _committed(p))
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


def _remote_entries(folder: RemotePath) -> list[tuple[int, RemotePath]]:
    try:
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return []
    except OSError as err:
        raise CheckpointError(
            f"cannot list checkpoint folder {str(folder)!r}: {type(err).__name__}: {err}; check the URL and the "
            "credentials"
        ) from err
    found = []
    for entry in entries:
        m = CHECKPOINT_NAME.match(entry.name)
        if m and entry.is_dir() == (m.group(2) == "dcp"):  # an object ckpt_<step>.pt, a prefix ckpt_<step>.dcp/
            found.append((int(m.group(1)), entry))
    return found


def _committed(folder: RemotePath) -> bool:
    return (folder / MANIFEST).exists()


def uncommitted(folder: Location) -> list[Location]:
    """The sharded checkpoint folders of an object store's folder that have no manifest: saves in progress or killed
    (on local disk a save never shows under its name before its rename: [])."""
    if not isinstance(folder, RemotePath):
        return []
    return [p for _, p in _remote_entries(folder) if p.suffix == ".dcp" and not _committed(p)]


def exists(path: Location) -> bool:
    """Whether ``path`` is there (a local link counts as itself, not its target)."""
    return path.exists() if isinstance(path, RemotePath) else os.path.lexists(path)


def check_numbered(path: Location, step: int, verify: bool) -> CheckpointInfo:
    """``path``'s :class:`CheckpointInfo` if it is a complete checkpoint of ``step`` (its name's), else raise
    :class:`CheckpointError` (``verify``: every record's CRC-32 too). A checkpoint this process checked as deeply
    before, unchanged since (:mod:`.checked`), is not read again.

    The one verdict on whether a folder's checkpoint is complete and usable (:func:`inspect_checkpoint`, and the step
    in its name): the manager's choice and its fallback, :func:`latest_checkpoint`, rotation and ``dist-resume list``
    all ask it, so none of them takes a checkpoint another passes over. A snapshot's reader can ask it too (``step``:
    the step its record names)."""
    known = recall(path, verify)
    if known is not None and known.step == step:
        return known
    before = signature(path)
    info = inspect_checkpoint(path, verify=verify)
    if info.step != step:
        raise NotACheckpointError(
            f"{str(path)!r} is named for step {step} but its metadata says step "
            f"{info.step}; it was renamed or copied by hand: rename it to "
            f"{(sharded_checkpoint_name if path.suffix == '.dcp' else checkpoint_name)(info.step or 0)!r} or remove it"
        )
    remember(path, info, verify, before)
    return info


def first_valid(
    candidates: Iterable[tuple[int, Location]], verify: bool
) -> tuple[CheckpointInfo | None, list[tuple[Location, Exception]]]:
    """The first of ``candidates`` ((step, path), newest first) that is complete, and those skipped before it, each
    with its error. Local; logs nothing (:func:`find_latest` does).

    A candidate that is gone by the time it is looked at (a writer's rotation deleted it after the listing) is not
    damaged: it is left out, and :func:`find_latest` lists the folder again when nothing else was found."""
    skipped: list[tuple[Location, Exception]] = []
    for step, path in candidates:
        try:
            return check_numbered(path, step, verify), skipped
        except (CheckpointError, OSError) as err:
            if exists(path):
                skipped.append((path, err))
    return None, skipped


def find_latest(
    folder: Location, verify: bool, numbered: list[tuple[int, Location]] | None = None
) -> tuple[CheckpointInfo | None, list[tuple[Location, Exception]]]:
    """The newest complete checkpoint, and the newer ones skipped on the way, each with its error (logged).

    ``numbered`` is the folder's :func:`numbered_checkpoints` when the caller has listed it already. When nothing
    complete is found and some candidate vanished meanwhile (a writer saved and rotated), the folder is listed again,
    up to :data:`RELISTS` times: a reader racing a writer finds the newest checkpoint, never a healthy folder called
    damaged."""
    listing = numbered_checkpoints(folder) if numbered is None else numbered
    for _ in range(RELISTS):
        info, skipped = first_valid(reversed(listing), verify)
        if info is not None or all(exists(p) for _, p in listing):
            break
        listing = numbered_checkpoints(folder)
    for path, err in skipped:
        logger.warning("skipping checkpoint %s: %s", path, err)
    return info, skipped


def latest_checkpoint(folder: PathLike, *, verify: bool = True) -> Location | None:
    """The newest complete checkpoint in ``folder``, or None when there is none (or no folder).

    Local. Newer checkpoints that fail the check are skipped, each logged (logger ``dist_resume``,
    WARNING) with the reason. ``verify=True`` checks the CRC-32 of every record (reads each
    candidate once); ``verify=False`` checks the zip structure and metadata only (a sharded
    checkpoint folder: its manifest and every file's size). Temporary files and folders of
    interrupted saves never count. Under torch.distributed use :func:`resume` (or
    :func:`resolve_checkpoint`) with the folder instead, so that every rank agrees. ``folder`` may be a URL
    (``s3://bucket/run``): the result is then a ``RemotePath`` (``str()`` gives its URL).

    Example::

        >>> mgr = dist_resume.CheckpointManager("ckpts", keep_last=2)
        >>> mgr.save(100, model=torch.nn.Linear(2, 2))
        PosixPath('ckpts/ckpt_00000100.pt')
        >>> dist_resume.tools.latest_checkpoint("ckpts")
        PosixPath('ckpts/ckpt_00000100.pt')
    """
    info, _ = find_latest(location(folder), verify)
    return None if info is None else info.path
