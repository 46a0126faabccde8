"""After a save into a checkpoint folder: temporary files of interrupted saves removed, old checkpoints rotated out.

Both run on the writing rank only, under the folder's lock (:mod:`~dist_resume._manager.lock`),
and both only log what they cannot delete: a file left behind never fails a save that succeeded.

A checkpoint is a file ``ckpt_<step>.pt`` or a sharded checkpoint folder ``ckpt_<step>.dcp/``; a folder
is deleted as a whole, and the checkpoint of the step just saved in the other form (a file where a folder
was just written, or the reverse) is superseded and deleted with the rotation.

Rotation never trades a valid fallback for a damaged file: before it deletes anything, every checkpoint it keeps has
passed the check ``latest()`` makes, every CRC-32 included. Each checkpoint is read for that once in its life: the one
just saved right after its write (a file read back whole; a sharded folder's manifest holds the CRC-32s its ranks
read back before the commit), in the save's background thread for ``save_async``; an older one the first time
rotation needs it (then remembered by inode, size and modification time, :mod:`~dist_resume._source.checked`, as
``latest()`` and a resume's choice remember theirs). Older checkpoints past ``keep_last`` are checked for structure
only, without their CRC pass. A checkpoint that fails (empty, truncated, a flipped byte, foreign, unreadable) takes
no ``keep_last`` slot, is never the reason a valid one is deleted, and is left where it is: deleting it would destroy
what may be the only copy of a run's state, and moving it would rename what the user sees in ``dist-resume list`` and
in the logs. Each save names the damaged checkpoints in one warning. Rotation deletes directory entries only: a
``ckpt_<step>.pt`` (or ``.dcp``) that is a symlink is removed as a link, whatever it points to is never touched; a
folder is first renamed aside (readers listing the folder meanwhile see it gone at once, never half deleted), then
removed without following any link in it.
"""

from __future__ import annotations

import logging
import os
import secrets

from .._core.errors import CheckpointError, CheckpointWriteError
from .._core.location import Location, RemotePath
from .._core.log import log_rank0, logger
from .._core.text import preview
from .._format.atomic import TEMP_NAME, remove_path
from .._format.manifest import MANIFEST
from .._source.checked import forget, remember, signature
from .._source.listing import CHECKPOINT_NAME, check_numbered, exists, first_valid, numbered_checkpoints, uncommitted
from .._store.upload import abort_unfinished

__all__ = ["remove_leftovers", "rotate_out", "check_new"]


def check_new(path: Location, step: int) -> Exception | None:
    """Check the checkpoint just written for ``step`` once, right after its write; why it does not count, or None.

    A file is read back whole (every CRC-32); a sharded folder is checked for structure (manifest, files, sizes,
    ``.metadata``) and then counts as verified: its manifest's CRC-32s are what its ranks read back before the
    commit. An object just uploaded to a store is checked for structure too (its directory, small records and
    metadata), not downloaded again: its bytes are those the store acknowledged, part by part, with their checksums."""
    try:
        if path.is_dir() or isinstance(path, RemotePath):
            before = signature(path)
            remember(path, check_numbered(path, step, verify=False), True, before)
        else:
            check_numbered(path, step, verify=True)
    except (CheckpointError, OSError) as err:
        logger.error(
            "the checkpoint just saved, %s, does not read back intact (%s); it takes no keep_last slot", path, err
        )
        return err
    return None


def _problem(path: Location, step: int, verify: bool) -> Exception | None:
    """Why ``path`` does not count as a checkpoint of ``step`` (``verify``: every CRC-32 too), or None when it does."""
    try:
        check_numbered(path, step, verify=verify)
    except (CheckpointError, OSError) as err:
        return err
    return None


def remove_leftovers(folder: Location) -> None:
    """Delete the temporary files and folders of interrupted checkpoint saves in ``folder``
    (``.ckpt_<step>.pt.<16 hex>.tmp``, ``.ckpt_<step>.dcp.<16 hex>.tmp/``); nothing else is touched, a
    symlink is removed as a link, and a folder without following any link in it. An unlistable folder
    raises :class:`CheckpointWriteError`. On an object store: the sharded folders without a manifest (saves killed
    mid-upload) and the unfinished multipart uploads of this folder's checkpoints."""
    if isinstance(folder, RemotePath):
        _remove_remote_leftovers(folder)
        return
    try:
        names = os.listdir(folder)
    except OSError as err:
        raise CheckpointWriteError(
            f"cannot list the checkpoint folder {str(folder)!r}: {err.strerror or err}; check the path and its "
            "permissions"
        ) from err
    for name in names:
        found = TEMP_NAME.match(name)
        if found and CHECKPOINT_NAME.match(found.group("dest")):
            try:
                remove_path(folder / name)
                log_rank0(logging.DEBUG, "removed %s, left by an interrupted save", folder / name)
            except OSError as err:
                logger.warning("could not remove %s, left by an interrupted save: %s", name, err)


def _remove_remote_leftovers(folder: RemotePath) -> None:
    try:
        leftovers = uncommitted(folder)
    except CheckpointError as err:
        raise CheckpointWriteError(str(err)) from err
    for path in leftovers:
        try:
            remove_path(path)
            log_rank0(logging.DEBUG, "removed %s, left by an interrupted save", path)
        except OSError as err:
            logger.warning("could not remove %s, left by an interrupted save: %s", path, err)
    for key in abort_unfinished(folder, lambda name: CHECKPOINT_NAME.match(name) is not None):
        log_rank0(logging.DEBUG, "aborted the unfinished upload of %s, left by an interrupted save", key)


def _reason(path: Location, err: Exception) -> str:
    """``ckpt_00000400.pt is empty (0 bytes), ...``: the error's own words, with the file named once."""
    text = str(err)
    for subject in (f"checkpoint {str(path)!r} ", f"{str(path)!r} "):
        if text.startswith(subject):
            text = f"{path.name} {text[len(subject) :]}"
            break
    else:
        text = f"{path.name} ({type(err).__name__}: {text.replace(str(path), path.name)})"
    return text if len(text) <= 240 else text[:237] + "..."


def rotate_out(folder: Location, new: Location, step: int, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` valid checkpoints of ``folder``, never ``new`` (just written for
    ``step``); name the damaged ones in one warning; warn when valid later steps exist, which latest() would pick.

    Each checkpoint kept is known sound, every CRC-32 included (``new`` checked by :func:`check_new` now, unless
    the caller did in the background)."""
    fresh = check_new(new, step)
    valid: list[tuple[int, Location]] = []  # newest first
    damaged: list[tuple[Location, Exception]] = [] if fresh is None else [(new, fresh)]
    superseded: list[tuple[int, Location]] = []  # the step just saved, in the other form (file / folder)
    for s, path in reversed(numbered_checkpoints(folder)):
        if s == step and path != new:
            superseded.append((s, path))
            continue
        if path == new:
            if fresh is None:
                valid.append((s, path))
            continue
        err = _problem(path, s, verify=len(valid) < keep_last)  # a checkpoint that will be kept: every CRC
        if err is None:
            valid.append((s, path))
        elif exists(path):  # (one gone meanwhile was deleted by hand: nothing to do)
            damaged.append((path, err))
    later = [(s, path) for s, path in valid if s > step]
    pick = new
    if later:
        # latest() and resume() check every CRC of the newest candidates: pick as they (and `dist-resume list`) do
        info, failed = first_valid(later, verify=True)
        damaged += failed
        valid = [(s, p) for s, p in valid if p not in {f for f, _ in failed}]
        if info is not None:
            pick = info.path
            logger.warning(
                "saved step %d into %s, which already holds later steps %s: latest() and resume() will pick %s; "
                "delete the later ones if that run was abandoned",
                step,
                folder,
                [p.name for s, p in valid if s > step],
                pick.name,
            )
    if damaged:
        logger.warning(
            "checkpoint folder %s holds %d damaged checkpoint file(s), which take no keep_last slot and are left in "
            "place: %s; latest() and resume() skip them and pick %s; delete them once you have looked "
            "(`dist-resume list %s` shows each with its reason)",
            folder,
            len(damaged),
            preview((_reason(p, e) for p, e in damaged), 10, sep="; ", quote=False),
            pick.name,
            folder,
        )
    keep = {path for _, path in valid[:keep_last]} | {new}
    for _, path in [*superseded, *valid]:
        if path not in keep:
            _delete(path, f"superseded by {new.name}" if (step, path) in superseded else f"keep_last={keep_last}")


def _delete(path: Location, why: str) -> None:
    """Remove one checkpoint: a link as a link; a folder renamed aside first (a :data:`TEMP_NAME`, which the next
    save's :func:`remove_leftovers` finishes if this one cannot), so that a reader never meets it half deleted. On an
    object store a sharded folder loses its manifest first: from then on no reader lists it."""
    try:
        if isinstance(path, RemotePath):
            if path.suffix == ".dcp":
                (path / MANIFEST).unlink(missing_ok=True)
            remove_path(path)
        elif path.is_dir() and not path.is_symlink():
            aside = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
            os.rename(path, aside)
            remove_path(aside)
        else:
            remove_path(path)  # a symlink goes as a link: its target is never touched
        if exists(path):
            raise OSError(f"{path.name} is still there (a file in it could not be deleted)")
        log_rank0(logging.DEBUG, "rotated out %s (%s)", path, why)
    except OSError as err:
        logger.warning("could not delete old checkpoint %s: %s", path, err)
    forget(path)
