"""The small records of a torch zip file, CRC-32 checked on every read before anything is unpickled.

``torch.load`` never checks a CRC (FACTS 6): a ``data.pkl`` with one changed byte that still
unpickles (a state key ``step`` that became ``Dtep``) loads without a word and fails later, after
part of the state was applied. Every record that is not tensor data (``data.pkl``, ``version``,
``byteorder``, ``.format_version``, ``.storage_alignment``, ``.data/serialization_id``) is small,
so :func:`read_checked_records` checks them all on every load and every structure read; tensor data
(``<archive>/data/<key>``) is checked only by a full verification, which reads the whole file.
"""

from __future__ import annotations

import zipfile
import zlib
from dataclasses import dataclass
from typing import Any

from .._core.errors import CheckpointCorruptError
from .._core.location import Location, looked_up
from .._store.ranges import open_binary, prefetch
from .records import Record, read_records
from .safe_open import reading
from .zip_verify import integrity_failure, structure_findings

__all__ = ["CheckedRecords", "read_checked_records", "check_small_records"]


@dataclass(frozen=True, slots=True)
class CheckedRecords:
    """An archive whose small records passed their CRC-32 check; ``pickle``: ``data.pkl``'s bytes when asked."""

    archive_name: str
    records: list[Record]
    pickle: bytes | None


def _name(path: Location) -> str:
    return repr(str(path))


def read_checked_records(path: Location, *, keep_pickle: bool = False) -> CheckedRecords:
    """:func:`~.records.read_records`, then the CRC-32 of every record that is not tensor data.

    Local. A mismatch raises :class:`CheckpointCorruptError` naming the file and the record, before
    anything is unpickled. ``keep_pickle`` returns ``data.pkl``'s checked bytes, so the caller need
    not read it again. Costs one read of the small records (``data.pkl`` is most of it: about 50
    bytes per state-dict entry).

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> read_checked_records(Path("ckpt.pt")).archive_name
        'ckpt'
    """
    p = looked_up(path)
    archive_name, records = read_records(p)
    if findings := structure_findings(archive_name, records):  # checked on every read, verify= or not
        raise integrity_failure(
            repr(str(p)), findings, "the file was damaged or edited: resume from another checkpoint"
        )
    return CheckedRecords(archive_name, records, check_small_records(p, archive_name, records, keep_pickle))


def check_small_records(
    path: Location, archive_name: str, records: list[Record], keep_pickle: bool = False
) -> bytes | None:
    """The CRC-32 check of :func:`read_checked_records` on records already read; ``data.pkl``'s bytes if kept.
    An object's small records are fetched in one batch of ranges."""
    tensor_data, pickle_name = f"{archive_name}/data/", f"{archive_name}/data.pkl"
    kept: bytes | None = None
    with reading(path), open_binary(path) as f:  # removed since its directory was read: CheckpointNotFoundError
        small = [r for r in records if not r.name.startswith(tensor_data)]
        prefetch(f, [(r.data_offset, r.data_offset + r.compress_size) for r in small])
        for r in records:
            if r.name.startswith(tensor_data):
                continue
            try:
                data = _record_bytes(path, f, r)
            except OSError as err:  # an I/O error on a file whose directory was just read
                raise CheckpointCorruptError(
                    f"checkpoint {_name(path)} is damaged: its record {r.name!r} cannot be read "
                    f"({err.strerror or err}); resume from an earlier checkpoint"
                ) from err
            crc = zlib.crc32(data)
            if crc != r.crc:
                raise CheckpointCorruptError(
                    f"checkpoint {_name(path)} is damaged: its record {r.name!r} fails its CRC-32 check (recorded "
                    f"{r.crc:#010x}, data {crc:#010x}): its bytes changed after it was written (disk, copy or "
                    "transfer) and nothing was loaded from it; resume from an earlier checkpoint or copy it again"
                )
            if keep_pickle and r.name == pickle_name:
                kept = data
    return kept


def _record_bytes(path: Location, f: Any, record: Record) -> bytes:
    """The uncompressed bytes of one record (:func:`~.records.read_records` checked its bounds)."""
    f.seek(record.data_offset)
    raw: bytes = f.read(record.compress_size)
    try:
        if len(raw) != record.compress_size:  # the file shrank since its directory was read
            raise EOFError(f"{len(raw)} of {record.compress_size} bytes")
        if record.compress_type == zipfile.ZIP_STORED:
            return raw
        data = zlib.decompressobj(-zlib.MAX_WBITS).decompress(raw, record.file_size + 1)
        if len(data) != record.file_size:
            raise zlib.error(f"inflates to {len(data)} bytes, not {record.file_size}")
    except (zlib.error, EOFError) as err:
        raise CheckpointCorruptError(
            f"checkpoint {_name(path)} is damaged: its record {record.name!r} cannot be read ({err}); "
            "resume from an earlier checkpoint"
        ) from err
    return data
