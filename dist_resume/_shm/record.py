"""A snapshot's commit record: the small JSON file whose presence makes a snapshot complete, parsed at one boundary.

A part's two slots are ``<part>.a.pt``/``<part>.b.pt`` (the data: a standard torch file) and ``<part>.a.json``/
``<part>.b.json`` (their records). A record is written last (a temporary file renamed over the name), after the data
file is whole and its CRC-32 known; it holds the format version, the step (at most 2**63 - 1: a larger one is never
written), a sequence number (the order of commits, which a wall-clock jump cannot reverse), the data file's name, size
and CRC-32, the folder's path or URL, the folder's identity (:mod:`.identity`: the history the snapshot belongs to),
the uid, the creation time, whether the folder holds a copy (``persisted``) and the caller's metadata. :func:`parse_record` checks
every field and raises :class:`CheckpointCorruptError` for anything else: hostile JSON never escapes as another
exception. Torch-free.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointCorruptError, UsageError
from .identity import IDENTITY

__all__ = [
    "FORMAT",
    "VERSION",
    "SLOTS",
    "MAX_RECORD_BYTES",
    "MAX_STEP",
    "ENTRY",
    "Snapshot",
    "checked_step",
    "data_name",
    "record_name",
    "checked_metadata",
    "record_text",
    "parse_record",
    "write_record",
    "record_lock",
]

FORMAT: Final = "dist_resume.memory_snapshot"
VERSION: Final = 2  # 2: the folder's identity
SLOTS: Final = ("a", "b")
MAX_RECORD_BYTES: Final = 64 * 1024
_MAX_METADATA_BYTES: Final = 16 * 1024
_MAX_INT: Final = 2**63 - 1
MAX_STEP: Final = _MAX_INT
"""The largest step a snapshot records (a checkpoint's step is an int64 wherever it is read)."""
_PART = r"[a-z0-9][a-z0-9_-]{0,63}"
ENTRY: Final = re.compile(
    rf"^(?:(?P<part>{_PART})\.(?P<slot>[ab])\.(?:pt|json)|\.{_PART}\.[ab]\.json\.[0-9a-f]{{16}}\.tmp)$"
)
"""Every name this store creates in a folder's directory: data files, records and temporary records."""

_locks: dict[Path, threading.Lock] = {}
_locks_lock = threading.Lock()


def _forget_in_child() -> None:
    """In a forked child: no lock a parent's thread (a commit) held at the fork is held here."""
    global _locks_lock
    _locks_lock = threading.Lock()
    _locks.clear()


os.register_at_fork(after_in_child=_forget_in_child)

_CREATE_NEW: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One complete snapshot in shared memory: a standard torch file at ``path`` and what its record says. Local.

    ``path`` loads with ``torch.load(path, weights_only=True)``, ``dist_resume.load_checkpoint(path)`` and
    ``dist_resume.resume(path, ...)``. ``seq`` orders the commits of a part (the newest is the highest);
    ``persisted`` says whether the folder holds a copy (:func:`~dist_resume._shm.persist.mark_persisted`);
    ``metadata`` is the caller's dict (world size, epoch, ...), left out of comparisons; ``identity`` the folder's
    (:mod:`~dist_resume._shm.identity`) when it was written."""

    step: int
    path: Path
    size: int
    created: float
    metadata: Mapping[str, Any] = field(compare=False)
    part: str
    slot: str
    seq: int
    crc32: int
    folder: str
    persisted: bool
    identity: str


def checked_step(step: object) -> int:
    """``step`` when it is an int in ``0 ..`` :data:`MAX_STEP`; :class:`UsageError` otherwise (nothing past int64 is
    ever written)."""
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise UsageError(
            f"a snapshot's step must be an int in 0..{MAX_STEP} (int64), got {type(step).__name__} "
            + (repr(step) if type(step) is int and step.bit_length() < 200 else "")
        )
    return step


def data_name(part: str, slot: str) -> str:
    """The name of a slot's data file: ``state.a.pt``."""
    return f"{part}.{slot}.pt"


def record_name(part: str, slot: str) -> str:
    """The name of a slot's commit record: ``state.a.json``."""
    return f"{part}.{slot}.json"


def checked_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """``metadata`` as a plain dict once it is known to be small JSON with string keys; :class:`UsageError` else."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(isinstance(k, str) for k in metadata):
        raise UsageError(
            f"snapshot metadata must be a dict with str keys, got {type(metadata).__name__}",
            hint='pass plain values, e.g. {"world_size": 2, "epoch": 3}',
        )
    try:
        text = json.dumps(dict(metadata), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise UsageError(
            f"snapshot metadata is not JSON ({err})", hint="keep it to str, int, float, bool, None, lists and dicts"
        ) from err
    if len(text) > _MAX_METADATA_BYTES:
        raise UsageError(
            f"snapshot metadata is {len(text)} bytes as JSON, more than {_MAX_METADATA_BYTES}",
            hint="keep a few small values in it; tensors and large objects belong in the snapshot itself",
        )
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def record_text(snapshot: Snapshot) -> bytes:
    """The commit record of ``snapshot``, as written."""
    record = {
        "format": FORMAT,
        "version": VERSION,
        "step": snapshot.step,
        "seq": snapshot.seq,
        "part": snapshot.part,
        "slot": snapshot.slot,
        "file": snapshot.path.name,
        "size": snapshot.size,
        "crc32": snapshot.crc32,
        "folder": snapshot.folder,
        "identity": snapshot.identity,
        "uid": os.getuid(),
        "created": snapshot.created,
        "persisted": snapshot.persisted,
        "metadata": dict(snapshot.metadata),
    }
    return json.dumps(record, allow_nan=False, sort_keys=True).encode()


def _bad(name: str, why: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(f"snapshot record {name}: {why}")


def _field(record: Mapping[str, Any], key: str, name: str) -> Any:
    if key not in record:
        raise _bad(name, f"the field {key!r} is missing")
    return record[key]


def _count(record: Mapping[str, Any], key: str, name: str, limit: int = _MAX_INT) -> int:
    value = _field(record, key, name)
    if type(value) is not int or not 0 <= value <= limit:
        raise _bad(name, f"{key} is {type(value).__name__}, not an integer in 0..{limit}")
    return value


def _equal(record: Mapping[str, Any], key: str, expected: object, name: str) -> None:
    value = _field(record, key, name)
    if type(value) is not type(expected) or value != expected:
        shown = repr(value)[:80] if isinstance(value, (str, int)) else type(value).__name__
        raise _bad(name, f"{key} is {shown}, expected {expected!r}")


def _created(record: Mapping[str, Any], name: str) -> float:
    value = _field(record, "created", name)
    if type(value) is int and 0 <= value <= _MAX_INT:
        return float(value)
    if type(value) is float and math.isfinite(value) and value >= 0:
        return value
    raise _bad(name, f"created is {type(value).__name__}, not a time in seconds")


def parse_record(raw: bytes, *, folder: str, part: str, slot: str, path: Path) -> Snapshot:
    """The :class:`Snapshot` a record describes, for the data file ``path`` of ``folder``'s ``part`` in ``slot``.

    Every field is checked (types, ranges, the file name, the folder, the uid); anything else, including JSON that
    does not parse, is a :class:`CheckpointCorruptError` saying what is wrong. Never raises anything else."""
    name = record_name(part, slot)
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise _bad(name, f"not JSON ({type(err).__name__})") from None
    if not isinstance(record, dict):
        raise _bad(name, f"a JSON {type(record).__name__}, not an object")
    _equal(record, "format", FORMAT, name)
    _equal(record, "version", VERSION, name)
    _equal(record, "part", part, name)
    _equal(record, "slot", slot, name)
    _equal(record, "file", path.name, name)
    _equal(record, "uid", os.getuid(), name)
    if _field(record, "folder", name) != folder:
        raise _bad(name, "it belongs to another checkpoint folder")
    persisted = _field(record, "persisted", name)
    metadata = _field(record, "metadata", name)
    identity = _field(record, "identity", name)
    if type(identity) is not str or IDENTITY.match(identity) is None:
        raise _bad(name, f"identity is {type(identity).__name__}, not a folder's identity")
    if type(persisted) is not bool:
        raise _bad(name, f"persisted is {type(persisted).__name__}, not a bool")
    if not isinstance(metadata, dict):
        raise _bad(name, f"metadata is {type(metadata).__name__}, not an object")
    return Snapshot(
        step=_count(record, "step", name),
        path=path,
        size=_count(record, "size", name),
        created=_created(record, name),
        metadata=metadata,
        part=part,
        slot=slot,
        seq=_count(record, "seq", name),
        crc32=_count(record, "crc32", name, 2**32 - 1),
        folder=folder,
        persisted=persisted,
        identity=identity,
    )


def write_record(snapshot: Snapshot) -> None:
    """Write ``snapshot``'s commit record next to its data file, atomically (a new temporary file, renamed in).

    A process killed before the rename leaves no record (a stray ``.<part>.<slot>.json.<hex>.tmp`` at most, which
    the next write of the part removes). Raises ``OSError``."""
    store = snapshot.path.parent
    dest = store / record_name(snapshot.part, snapshot.slot)
    tmp = store / f".{dest.name}.{secrets.token_hex(8)}.tmp"
    fd = os.open(tmp, _CREATE_NEW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(record_text(snapshot))
            f.flush()
            os.fsync(f.fileno())  # free on a tmpfs; a DIST_RESUME_SHM_DIR on disk gets the same order as memory
        os.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def record_lock(store: Path) -> threading.Lock:
    """The lock this process holds while it changes a record in ``store``: a commit in a background thread, marking a
    snapshot persisted and the next write's removal of a record never interleave."""
    with _locks_lock:
        return _locks.setdefault(store, threading.Lock())
