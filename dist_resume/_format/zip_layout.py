"""The whole layout of a torch zip archive, computed before any byte is written, so several writers can fill it at once.

:class:`~dist_resume._format.zip_write.ZipWriter` places each record after the previous one as it goes;
:func:`plan_layout` places every record up front, from its name, size and alignment alone, so that each writer knows
where its records' data go (``data_offset``) before the others have written theirs. A record aligned to 64 bytes (or
less) sits where torch's writer would put it: right after the previous record, its data padded onto a 64-byte boundary
by the ``FB`` extra field. A record aligned further (1 MiB, what parallel filesystems want) starts on a page of its
own: its local header ends exactly where its data starts, on the boundary, and the bytes between the previous record
and that header are left unwritten (a hole, read as zeros; the central directory says where every header is, which
is all ``torch.load``, ``zipfile`` and :func:`~dist_resume._format.records.read_records` go by). The record after an
aligned one, and the central directory after it, start on a page boundary too: no page holds bytes of two records
that different writers may fill.

The local headers carry no CRC (a data descriptor follows each record's data, as miniz writes it), so they may be
written before the data; the descriptors and the central directory need each record's CRC-32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from .zip_write import ALIGNMENT, central_entry, data_descriptor, end_records, local_header

__all__ = ["PAGE", "RecordSpec", "PlacedRecord", "ZipLayout", "plan_layout"]

PAGE: Final = 4096
"""The page size the layout keeps writers apart by (a multiple of the 4 KiB pages of every common filesystem)."""


@dataclass(frozen=True, slots=True)
class RecordSpec:
    """A record to place: its full name (``archive/data/3``), its stored size and the alignment of its data."""

    name: str
    size: int
    alignment: int = ALIGNMENT


@dataclass(frozen=True, slots=True)
class PlacedRecord:
    """A record's place in the archive: its local header at ``header_offset``, its data at ``data_offset``."""

    name: str
    size: int
    header_offset: int
    data_offset: int
    header: bytes  # the local header, name and extra field: written at header_offset, ends at data_offset

    @property
    def data_end(self) -> int:
        return self.data_offset + self.size

    def descriptor(self, crc: int) -> bytes:
        """The data descriptor written at :attr:`data_end` (empty for an empty record). Local."""
        return data_descriptor(crc=crc, size=self.size, compress_size=self.size, header=self.header_offset)

    @property
    def end(self) -> int:
        """Where the record ends, its data descriptor included."""
        return self.data_end + len(self.descriptor(0))

    def central(self, crc: int) -> bytes:
        """The record's central directory entry. Local."""
        return central_entry(
            self.name.encode("utf-8"), size=self.size, compress_size=self.size, header=self.header_offset, crc=crc
        )


@dataclass(frozen=True, slots=True)
class ZipLayout:
    """Every record's place, and where the central directory starts."""

    records: tuple[PlacedRecord, ...]
    central_offset: int

    def tail(self, crcs: Sequence[int]) -> bytes:
        """The central directory and the end records, written at :attr:`central_offset` (one CRC per record). Local."""
        if len(crcs) != len(self.records):
            raise ValueError(f"{len(crcs)} CRCs for {len(self.records)} records")
        central = b"".join(r.central(crc) for r, crc in zip(self.records, crcs))
        return central + end_records(
            central_offset=self.central_offset, central_size=len(central), count=len(self.records)
        )

    def size(self, crcs: Sequence[int]) -> int:
        """The archive's size once its tail is written."""
        return self.central_offset + len(self.tail(crcs))


def _align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _place_aligned(encoded: bytes, size: int, cursor: int, alignment: int) -> tuple[int, bytes]:
    """(header offset, header bytes) of a record whose data starts on an ``alignment`` boundary at or after
    ``cursor`` plus its header: the header sits right before the data, with an empty ``FB`` field."""
    header_offset = cursor
    while True:  # the header's length depends on whether its offset reaches 4 GiB (a zip64 field): settle it
        length = len(local_header(encoded, size=size, compress_size=size, header=header_offset, alignment=1))
        data = _align_up(cursor + length, alignment)
        if data - length == header_offset:
            break
        header_offset = data - length
    return header_offset, local_header(encoded, size=size, compress_size=size, header=header_offset, alignment=1)


def plan_layout(specs: Sequence[RecordSpec]) -> ZipLayout:
    """Place ``specs`` in order (see the module's docstring); deterministic: the same specs give the same layout.

    Local. With every alignment at most 64 the offsets are the ones :class:`~dist_resume._format.zip_write.ZipWriter`
    gives the same records.

    Example::

        >>> layout = plan_layout([RecordSpec("archive/data.pkl", 100), RecordSpec("archive/data/0", 8 << 20, 1 << 20)])
        >>> layout.records[1].data_offset % (1 << 20)
        0
    """
    placed: list[PlacedRecord] = []
    cursor = 0
    previous_aligned = False
    for spec in specs:
        if spec.size < 0 or spec.alignment < 1:
            raise ValueError(f"record {spec.name!r}: size {spec.size} and alignment {spec.alignment} are not valid")
        encoded = spec.name.encode("utf-8")
        aligned = spec.alignment > ALIGNMENT
        if aligned or previous_aligned:
            cursor = _align_up(cursor, PAGE)
        if aligned:
            header_offset, header = _place_aligned(encoded, spec.size, cursor, spec.alignment)
        else:
            header_offset = cursor
            header = local_header(encoded, size=spec.size, compress_size=spec.size, header=cursor)
        record = PlacedRecord(spec.name, spec.size, header_offset, header_offset + len(header), header)
        placed.append(record)
        cursor, previous_aligned = record.end, aligned
    if previous_aligned:
        cursor = _align_up(cursor, PAGE)
    return ZipLayout(tuple(placed), cursor)
