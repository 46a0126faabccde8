"""A folder's complete snapshots on this node: their records parsed and checked, naming the folder's identity
(:mod:`.identity`), the data files owned, whole and (with ``verify``) matching their CRC-32, and (for the newest, with
the caller's check) usable. Anything else is ignored with one WARNING (a snapshot of another identity silently: it is
stale, and :func:`~dist_resume._shm.persist.remove_stale` removes it); nothing here raises for what it finds in
shared memory. Torch-free.
"""

from __future__ import annotations

import logging
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Final, Literal

from .._core.errors import CheckpointCorruptError
from .._core.location import Location
from .identity import read_identity
from .place import check_part, folder_key, open_owned, owned_store, store_dir
from .record import ENTRY, MAX_RECORD_BYTES, SLOTS, Snapshot, data_name, parse_record, record_name

__all__ = ["CHUNK", "Identity", "file_crc", "snapshots", "newest_snapshot", "slot_snapshots", "stale_snapshots"]

Identity = str | None | Literal["folder"]
"""Which snapshots count: those of this folder identity (a manager's, learned from rank 0), none (None: the folder
has no identity), or those of the identity the folder keeps, read from it (``"folder"``: what a local tool sees)."""

CHUNK: Final = 8 * 2**20
"""The bytes read at a time to compute or copy a data file."""

logger = logging.getLogger("dist_resume")  # the library logger (dist_resume._core.log imports torch)


def file_crc(fd: int) -> tuple[int, int]:
    """The CRC-32 (``zlib.crc32``) and the length of what the descriptor ``fd`` reads from its start. Local."""
    crc, total = 0, 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(fd, "rb", buffering=0, closefd=False) as f:
        f.seek(0)
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            total += n
    return crc, total


def _read_record(store: Path, key: str, part: str, slot: str) -> Snapshot | None:
    """The snapshot a slot's record describes, None when it has none; a refused or bad record: a WARNING, None."""
    path = store / record_name(part, slot)
    try:
        fd, st = open_owned(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        logger.warning("ignoring the snapshot record %s: %s", path, err)
        return None
    try:
        if st.st_size > MAX_RECORD_BYTES:
            logger.warning("ignoring the snapshot record %s: %d bytes, more than a record holds", path, st.st_size)
            return None
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    except OSError as err:
        logger.warning("ignoring the snapshot record %s: %s", path, err)
        return None
    finally:
        os.close(fd)
    try:
        return parse_record(raw, folder=key, part=part, slot=slot, path=store / data_name(part, slot))
    except CheckpointCorruptError as err:
        logger.warning("ignoring a snapshot in %s: %s", store, err)
        return None


def _whole(snapshot: Snapshot, verify: bool) -> bool:
    """Whether the data file is this user's regular file of the recorded size (and CRC-32, with ``verify``)."""
    try:
        fd, st = open_owned(snapshot.path)
    except OSError as err:
        logger.warning("ignoring the snapshot of step %d: its data file %s: %s", snapshot.step, snapshot.path, err)
        return False
    try:
        if st.st_size != snapshot.size:
            found = f"{st.st_size} bytes, the record says {snapshot.size}"
        elif verify and (crc := file_crc(fd)) != (snapshot.crc32, snapshot.size):
            found = f"CRC-32 {crc[0]:08x} over {crc[1]} bytes, the record says {snapshot.crc32:08x}"
        else:
            return True
    except OSError as err:
        found = str(err)
    finally:
        os.close(fd)
    logger.warning(
        "ignoring the snapshot of step %d in %s: its data file holds %s (damaged or overwritten)",
        snapshot.step,
        snapshot.path,
        found,
    )
    return False


def _records(store: Path, key: str, part: str) -> list[Snapshot]:
    found = [_read_record(store, key, part, slot) for slot in SLOTS]
    return [s for s in found if s is not None]


def slot_snapshots(store: Path, key: str, part: str, *, identity: str | None, verify: bool = False) -> list[Snapshot]:
    """The complete snapshots in ``part``'s two slots of ``store`` (a directory already checked as owned) that belong
    to the folder identity ``identity`` (None: none does)."""
    return [s for s in _records(store, key, part) if s.identity == identity and _whole(s, verify)]


def stale_snapshots(store: Path, key: str, part: str, identity: str | None) -> list[Snapshot]:
    """The snapshots in ``part``'s slots of ``store`` whose records name another folder identity than ``identity``:
    another history of the folder's path (deleted and made again, or another run's)."""
    return [s for s in _records(store, key, part) if s.identity != identity]


def _identity(folder: Location, identity: Identity) -> str | None:
    return read_identity(folder) if identity == "folder" else identity


def snapshots(
    folder: Location, *, part: str | None = None, verify: bool = False, identity: Identity = "folder"
) -> list[Snapshot]:
    """The complete snapshots of ``folder`` on this node, oldest first (by part, then commit order). Local.

    ``part`` limits them to one part (``None``: every part found). A snapshot counts once its commit record parses,
    names this folder, this user and the folder's ``identity`` (see :data:`Identity`), and its data file is this
    user's regular file of the recorded size; ``verify=True`` also checks its CRC-32 (reads it whole). What fails is
    left out with one WARNING (a stale one, silently). Without shared memory (not Linux), an empty list.

    Example::

        >>> [(s.step, s.part) for s in snapshots(Path("ckpts"))]
        [(79, 'state'), (80, 'state')]
    """
    parts = [check_part(part)] if part is not None else None
    store = store_dir(folder)
    if store is None or not owned_store(store):
        return []
    if parts is None:
        names = (ENTRY.match(name) for name in sorted(os.listdir(store)))
        parts = sorted({m.group("part") for m in names if m is not None and m.group("part") is not None})
    key, mine = folder_key(folder), _identity(folder, identity)
    found = [s for p in parts for s in slot_snapshots(store, key, p, identity=mine, verify=verify)]
    return sorted(found, key=lambda s: (s.part, s.seq, s.created))


def newest_snapshot(
    folder: Location,
    *,
    part: str = "state",
    verify: bool = True,
    identity: Identity = "folder",
    usable: Callable[[Snapshot], str | None] | None = None,
) -> Snapshot | None:
    """``folder``'s newest complete snapshot of ``part`` on this node (the last committed), or None. Local.

    As :func:`snapshots`; ``verify`` (the default) checks the CRC-32 of the newest before returning it, and
    ``usable(snapshot)`` (the caller's check of its content: None, or why it cannot be resumed) after it; one that
    fails either gives way to the other slot's (one WARNING).

    Example::

        >>> snap = newest_snapshot(Path("ckpts"))
        >>> torch.load(snap.path, weights_only=True)["step"] if snap else None
        80
    """
    ordered = snapshots(folder, part=part, verify=False, identity=identity)
    for snapshot in reversed(ordered):
        if verify and not _whole(snapshot, verify=True):
            continue
        why = None if usable is None else usable(snapshot)
        if why is None:
            return snapshot
        logger.warning("ignoring the snapshot of step %d in %s: %s", snapshot.step, snapshot.path, why)
    return None
