"""A snapshot's file laid out before its bytes are copied in, and its CRC-32s taken after: the copy is the stall's only
pass over the data.

A :class:`FileLayout` is every byte of a zip file except its big records' data: the headers, the small records
(``data.pkl``), the data descriptors and the central directory (``fixed``), and where each big record's data goes
(:class:`Region`). The caller copies the regions' data into place; :func:`seal` then takes each region's CRC-32, writes
it where the zip keeps it (its data descriptor, its central directory entry) and returns the CRC-32 of the whole file,
combined from the regions' (:func:`crc32_combine`) so that no byte is read twice. :func:`read_layout` takes a layout
from a zip written with the regions left empty (a sparse scratch file). Torch-free.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

__all__ = ["Region", "FileLayout", "read_layout", "seal", "crc32_combine"]

_POLY: Final = 0xEDB88320  # CRC-32 (zlib, zip), reflected
_U32: Final = struct.Struct("<I")
_EOCD: Final = struct.Struct("<IHHHHIIH")
_LOCATOR64: Final = struct.Struct("<IIQI")
_EOCD64: Final = struct.Struct("<IQHHIIQQQQ")
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")
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


def _central_crc_offsets(fd: int, size: int) -> dict[str, int]:
    """Each record's name and where its CRC-32 sits in the central directory of the zip in ``fd`` (torch's writer
    always ends with the zip64 end record and its locator)."""
    tail = os.pread(fd, _LOCATOR64.size + _EOCD.size, size - _LOCATOR64.size - _EOCD.size)
    sig, _, eocd64, _ = _LOCATOR64.unpack_from(tail)
    if sig != 0x07064B50 or _EOCD.unpack_from(tail, _LOCATOR64.size)[0] != 0x06054B50:
        raise ValueError("the zip does not end with torch's zip64 end records")
    record = _EOCD64.unpack(os.pread(fd, _EOCD64.size, eocd64))
    count, cd_size, cd_offset = record[7], record[8], record[9]
    directory = os.pread(fd, cd_size, cd_offset)
    found: dict[str, int] = {}
    at = 0
    for _ in range(count):
        entry = _CENTRAL.unpack_from(directory, at)
        name_len, extra_len, comment_len = entry[10], entry[11], entry[12]
        name = directory[at + _CENTRAL.size : at + _CENTRAL.size + name_len].decode("utf-8")
        found[name] = cd_offset + at + 16  # the CRC-32 field of a central directory header
        at += _CENTRAL.size + name_len + extra_len + comment_len
    return found


def read_layout(fd: int, size: int, regions: Mapping[str, tuple[int, int]]) -> FileLayout:
    """The layout of the ``size``-byte zip in ``fd`` whose records named in ``regions`` (name: (data offset, size))
    were left empty: every other byte is read as it is, and each region's CRC-32 goes into its data descriptor
    (right after its data) and its central directory entry. Local."""
    central = _central_crc_offsets(fd, size)
    placed = sorted(
        (Region(offset, n, (offset + n + 4, central[name]) if n else ()) for name, (offset, n) in regions.items()),
        key=lambda r: r.offset,
    )
    fixed: list[tuple[int, bytes]] = []
    pos = 0
    for region in [*placed, Region(size, 0, ())]:
        if region.offset > pos:
            fixed.append((pos, os.pread(fd, region.offset - pos, pos)))
        pos = region.offset + region.size
    return FileLayout(size, tuple(fixed), tuple(placed))


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
