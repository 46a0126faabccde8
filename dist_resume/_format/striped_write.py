"""Filling a planned archive (:mod:`~dist_resume._format.striped_archive`) at explicit offsets: a storage record's
bytes, the frame around them (local headers, small records) and the tail (central directory, end records).

Several processes may do this at once on one file: each writes only its own records' bytes, each record's data
descriptor by the process that wrote its data (it has the CRC-32), the frame and the tail by one of them. Every
function is local and raises ``OSError`` as the writes do.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Final

from .striped_archive import ArchivePlan, StorageRecord
from .zip_write import write_all

__all__ = ["write_storage", "write_frame", "write_tail"]

_CHUNK: Final = 64 << 20


def write_storage(fd: int, data: memoryview, record: StorageRecord) -> int:
    """Write ``data`` (the record's storage bytes) at its data offset, then its data descriptor; its CRC-32."""
    if len(data) != record.nbytes:
        raise ValueError(f"record data/{record.index} holds {record.nbytes} bytes, not {len(data)}")
    crc = 0
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        write_all(fd, chunk, record.data_offset + start)
        crc = zlib.crc32(chunk, crc)
    descriptor = record.descriptor(crc)
    if descriptor:
        write_all(fd, descriptor, record.data_offset + record.nbytes)
    return crc


def write_frame(fd: int, plan: ArchivePlan) -> dict[int, int]:
    """Write every record's local header, and the small records (``data.pkl``, ``version``, ...) with their data
    descriptors; return the CRC-32 of each small record by its position in the layout."""
    crcs = {}
    for record in plan.layout.records:
        write_all(fd, record.header, record.header_offset)
    for position, data in plan.small.items():
        record = plan.layout.records[position]
        crc = zlib.crc32(data)
        write_all(fd, data + record.descriptor(crc), record.data_offset)
        crcs[position] = crc
    return crcs


def write_tail(fd: int, plan: ArchivePlan, crcs: Sequence[int]) -> int:
    """Write the central directory and the end records (``crcs``: one per record, in layout order); the file's size."""
    tail = plan.layout.tail(crcs)
    write_all(fd, tail, plan.layout.central_offset)
    return plan.layout.central_offset + len(tail)
