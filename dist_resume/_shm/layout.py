"""A snapshot's file laid out before its bytes are copied in, and its CRC-32s taken after: the copy is the stall's only
pass over the data.

A :class:`FileLayout` is every byte of a zip file except its big records' data: the headers, the small records
(``data.pkl``), the data descriptors and the central directory (``fixed``), and where each big record's data goes
(:class:`Region`). The caller copies the regions' data into place; :func:`seal` then takes each region's CRC-32, writes
it where the zip keeps it (its data descriptor, its central directory entry) and returns the CRC-32 of the whole file,
combined from the regions' (:func:`crc32_combine`) so that no byte is read twice. :func:`zip_file_layout` takes the layout of a zip
planned by :func:`~dist_resume._format.zip_layout.plan_layout`. Torch-free.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from .._format.zip_layout import ZipLayout

__all__ = ["Region", "FileLayout", "zip_file_layout", "seal", "crc32_combine"]

_POLY: Final = 0xEDB88320  # CRC-32 (zlib, zip), reflected
_U32: Final = struct.Struct("<I")
_CHAINED: Final = (
    1 << 20
)  # a region up to this size is hashed twice (its own CRC, then the file's): cheaper than combining


def _multmodp(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial (zlib's ``multmodp``)."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if not a & (m - 1):
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> tuple[int, ...]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


_X2N: Final = _x2n_table()  # x^(2^n) modulo the polynomial


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc1 = crc32(A)``, ``crc2 = crc32(B)`` and ``len(B)`` (zlib's
    ``crc32_combine``, which Python's zlib does not expose). Local.

    Example::

        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cd"), 2) == zlib.crc32(b"abcd")
        True
    """
    p, k, n = 1 << 31, 3, len2  # x^(8 * len2): 2^3 bits a byte
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return _multmodp(p, crc1) ^ crc2


@dataclass(frozen=True, slots=True)
class Region:
    """The ``size`` bytes at ``offset`` that the caller fills; their CRC-32 goes, as 4 little-endian bytes, at each of
    ``crc_at`` (every one after the region's end)."""

    offset: int
    size: int
    crc_at: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class FileLayout:
    """A file of ``size`` bytes: ``fixed`` (offset, bytes) pieces written as they are, ``regions`` (in file order, not
    overlapping ``fixed``) filled by the caller."""

    size: int
    fixed: tuple[tuple[int, bytes], ...]
    regions: tuple[Region, ...]

    def __post_init__(self) -> None:
        end = 0
        for region in self.regions:
            if region.offset < end or region.offset + region.size > self.size:
                raise ValueError(f"region at {region.offset} overlaps the one before it or ends past {self.size}")
            end = region.offset + region.size
            if any(not end <= at <= self.size - 4 for at in region.crc_at):
                raise ValueError(f"the CRC-32 of the region at {region.offset} must go after it, inside the file")


def zip_file_layout(layout: ZipLayout, small: Mapping[int, bytes]) -> FileLayout:
    """The file of the zip ``layout`` with the records at the positions of ``small`` holding those bytes and every other
    record a region: its CRC-32 goes into its data descriptor (right after its data) and its central directory entry.
    Local; the same bytes :class:`~dist_resume._format.zip_write.ZipWriter` writes for the same records.

    Example::

        >>> zip_layout = plan_layout([RecordSpec("archive/data.pkl", 3), RecordSpec("archive/data/0", 8)])
        >>> zip_file_layout(zip_layout, {0: b"pkl"}).regions[0].size
        8
    """
    crcs = [zlib.crc32(small[i]) if i in small else 0 for i in range(len(layout.records))]
    pieces: list[tuple[int, bytes]] = []
    regions: list[Region] = []
    central_at = layout.central_offset
    for i, record in enumerate(layout.records):
        descriptor = record.descriptor(crcs[i])
        if i in small:
            pieces.append((record.header_offset, record.header + small[i] + descriptor))
        else:
            pieces += [(record.header_offset, record.header), (record.data_end, descriptor)]
            if record.size:
                regions.append(Region(record.data_offset, record.size, (record.data_end + 4, central_at + 16)))
        central_at += len(record.central(0))  # 16: the CRC-32 field of a central directory header
    tail = layout.tail(crcs)
    pieces.append((layout.central_offset, tail))
    fixed: list[tuple[int, bytes]] = []
    for offset, data in pieces:  # adjacent pieces written as one
        if fixed and fixed[-1][0] + len(fixed[-1][1]) == offset:
            fixed[-1] = (fixed[-1][0], fixed[-1][1] + data)
        elif data:
            fixed.append((offset, data))
    return FileLayout(layout.central_offset + len(tail), tuple(fixed), tuple(regions))


def seal(view: memoryview, layout: FileLayout) -> int:
    """Write each region's CRC-32 where ``layout`` says, in ``view`` (the file's bytes, regions filled), and return
    the CRC-32 of the whole file as it then is. Reads each region once. Local."""
    whole, pos = 0, 0
    for region in layout.regions:
        whole = zlib.crc32(view[pos : region.offset], whole)
        data = view[region.offset : region.offset + region.size]
        crc = zlib.crc32(data)
        if region.size <= _CHAINED:
            whole = zlib.crc32(data, whole)
        else:
            whole = crc32_combine(whole, crc, region.size)
        for at in region.crc_at:
            _U32.pack_into(view, at, crc)
        pos = region.offset + region.size
    return zlib.crc32(view[pos : layout.size], whole)
