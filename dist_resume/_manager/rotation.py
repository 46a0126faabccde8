"""After a save into a checkpoint folder: temporary files of interrupted saves removed, old checkpoints rotated out.

Both run on the writing rank only, under the folder's lock (:mod:`~dist_resume._manager.lock`),
and both only log what they cannot delete: a file left behind never fails a save that succeeded.

A checkpoint is a file ``ckpt_<step>.pt`` or a sharded checkpoint folder ``ckpt_<step>.dcp/``; a folder
is deleted as a whole, and the checkpoint of the step just saved in the other form (a file where a folder
was just written, or the reverse) is superseded and deleted with the rotation.

Rotation counts valid checkpoints only. Every other ``ckpt_<step>.pt`` is checked as ``latest()``
checks it without its CRC pass (zip structure, the CRC-32 of the small records, dist_resume
metadata whose step matches the name); one that fails (empty, truncated, foreign, unreadable)
takes no ``keep_last`` slot, is never the reason a valid one is deleted, and is left where it is:
deleting it would destroy what may be the only copy of a run's state, and moving it would rename
what the user sees in ``dist-resume list`` and in the logs. Each save names the damaged files in
one warning. A file the toolkit wrote itself, or checked once, is not read again while it keeps
its inode, size and modification time (a 200,000-key checkpoint takes seconds to check). Rotation
deletes directory entries only: a ``ckpt_<step>.pt`` (or ``.dcp``) that is a symlink is removed as a
link, whatever it points to is never touched, and a folder is removed without following any link in it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

from .._core.errors import CheckpointError, CheckpointWriteError
from .._core.log import log_rank0, logger
from .._core.text import preview
from .._format.atomic import TEMP_NAME, remove_path
from .._source.listing import CHECKPOINT_NAME, check_numbered, first_valid, numbered_checkpoints

__all__ = ["remove_leftovers", "rotate_out", "remember_valid"]

_Signature = tuple[int, int, int, int, str]
_known_valid: dict[Path, _Signature] = {}  # checkpoints known to be complete, as they were then
_known_lock = threading.Lock()  # rotation runs in an async save's thread too


def _signature(path: Path) -> _Signature | None:
    """A file's inode, size and modification time; a folder's, with those of every file in it."""
    try:
        st = path.stat()
        inside = hashlib.sha256()
        if path.is_dir():
            for entry in sorted(os.scandir(path), key=lambda e: e.name):
                est = entry.stat()
                inside.update(f"{entry.name}\0{est.st_ino}\0{est.st_size}\0{est.st_mtime_ns}\n".encode())
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, inside.hexdigest())


def remember_valid(path: Path) -> None:
    """Record that ``path``, as it is now, is a complete checkpoint (the toolkit just wrote it)."""
    signature = _signature(path)
    if signature is not None:
        with _known_lock:
            _known_valid[path.absolute()] = signature


def _problem(path: Path, step: int) -> Exception | None:
    """Why ``path`` does not count as a checkpoint of ``step``, or None when it does."""
    key = path.absolute()
    with _known_lock:
        known = _known_valid.get(key)
    if known is not None and known == _signature(path):
        return None
    try:
        check_numbered(path, step, verify=False)
    except (CheckpointError, OSError) as err:
        return err
    remember_valid(path)
    return None


def remove_leftovers(folder: Path) -> None:
    """Delete the temporary files and folders of interrupted checkpoint saves in ``folder``
    (``.ckpt_<step>.pt.<16 hex>.tmp``, ``.ckpt_<step>.dcp.<16 hex>.tmp/``); nothing else is touched, a
    symlink is removed as a link, and a folder without following any link in it. An unlistable folder
    raises :class:`CheckpointWriteError`."""
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
                log_rank0(logging.INFO, "removed %s, left by an interrupted save", folder / name)
            except OSError as err:
                logger.warning("could not remove %s, left by an interrupted save: %s", name, err)


def _reason(path: Path, err: Exception) -> str:
    """``ckpt_00000400.pt is empty (0 bytes), ...``: the error's own words, with the file named once."""
    text = str(err)
    for subject in (f"checkpoint {str(path)!r} ", f"{str(path)!r} "):
        if text.startswith(subject):
            text = f"{path.name} {text[len(subject) :]}"
            break
    else:
        text = f"{path.name} ({type(err).__name__}: {text.replace(str(path), path.name)})"
    return text if len(text) <= 240 else text[:237] + "..."


def rotate_out(folder: Path, new: Path, step: int, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` valid checkpoints of ``folder``, never ``new`` (just written for
    ``step``); name the damaged files in one warning; warn when valid later steps exist, which latest() would pick."""
    remember_valid(new)
    valid: list[tuple[int, Path]] = []  # newest first
    damaged: list[tuple[Path, Exception]] = []
    superseded: list[tuple[int, Path]] = []  # the step just saved, in the other form (file / folder)
    for s, path in reversed(numbered_checkpoints(folder)):
        if s == step and path != new:
            superseded.append((s, path))
            continue
        err = None if path == new else _problem(path, s)
        if err is None:
            valid.append((s, path))
        else:
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
        if path in keep:
            continue
        try:
            remove_path(path)  # a symlink goes as a link: its target is never touched
            if os.path.lexists(path):
                raise OSError(f"{path.name} is still there (a file in it could not be deleted)")
            why = f"superseded by {new.name}" if (step, path) in superseded else f"keep_last={keep_last}"
            log_rank0(logging.INFO, "rotated out %s (%s)", path, why)
        except OSError as err:
            logger.warning("could not delete old checkpoint %s: %s", path, err)
        with _known_lock:
            _known_valid.pop(path.absolute(), None)
    if len(_known_valid) > 10_000:  # many folders in one long-lived process: forget the oldest
        with _known_lock:
            for key in list(_known_valid)[: len(_known_valid) // 2]:
                _known_valid.pop(key, None)
