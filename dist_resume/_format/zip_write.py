"""Writing zip archives with the layout of torch's own writer, record by record, at explicit offsets.

The output has the layout torch's writer (miniz, via ``PyTorchStreamWriter``) produces, which
``torch.load`` relies on when it computes storage offsets itself (``mmap``, ``map_location="meta"``):
records in the order they are added, each local header padded with an ``FB`` extra field so the
data starts on a 64-byte boundary, a data descriptor after every non-empty record, zip64 fields
where sizes or offsets reach 4 GiB. A record's data is written by a callback, so it may come from
another file (``copy_range``: inside the kernel), from a tensor, or piece by piece from the network;
its CRC-32 may be known beforehand or computed while it is written.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable
from typing import Final

from .._core.errors import CheckpointCorruptError
from .records import LOCAL_HEADER, LOCAL_SIGNATURE

__all__ = [
    "ALIGNMENT",
    "ZipWriter",
    "central_entry",
    "copy_range",
    "data_descriptor",
    "end_records",
    "local_header",
    "write_all",
]

ALIGNMENT: Final = 64  # torch's storage alignment (torch.utils.serialization.config.save.storage_alignment)
_U32: Final = 0xFFFFFFFF
_FLAG_UTF8: Final = 0x0800
_FLAG_DESCRIPTOR: Final = 0x0008
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_EOCD: Final = struct.Struct("<IHHHHIIH")
_EOCD64: Final = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64: Final = struct.Struct("<IIQI")


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` to ``fd`` at ``offset`` (``os.pwrite`` until done). Local."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes between files at explicit offsets, in the kernel when it can. Local."""
    copy = getattr(os, "copy_file_range", None)
    while count > 0:
        n = 0
        if copy is not None:
            try:
                n = copy(src, dst, count, src_offset, dst_offset)
            except OSError:  # EXDEV, ENOSYS, EOPNOTSUPP ...: plain reads and writes
                copy = None
        if copy is None:
            chunk = os.pread(src, min(count, 8 << 20), src_offset)
            write_all(dst, chunk, dst_offset)
            n = len(chunk)
        if n == 0:
            raise CheckpointCorruptError("the source checkpoint ended in the middle of a record (was it truncated?)")
        src_offset, dst_offset, count = src_offset + n, dst_offset + n, count - n


def _flags(compress_size: int) -> int:
    return _FLAG_UTF8 | (_FLAG_DESCRIPTOR if compress_size else 0)


def _version(size: int, compress_size: int, header: int) -> int:
    return 45 if size >= _U32 or compress_size >= _U32 or header >= _U32 else 0


def local_header(
    encoded: bytes, *, size: int, compress_size: int, header: int, method: int = 0, alignment: int = ALIGNMENT
) -> bytes:
    """The local header, name and extra field of a record whose header starts at ``header``: zip64 sizes and offset
    where they reach 4 GiB, then the ``FB`` field padding the data onto an ``alignment`` boundary (torch's writer
    always writes it, with 0 to 63 bytes of ``Z``). No CRC or size: a data descriptor follows the data. Local."""
    fields = b""
    if size >= _U32 or compress_size >= _U32:
        fields += struct.pack("<QQ", size, compress_size)
    if header >= _U32:
        fields += struct.pack("<Q", header)
    extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
    start = header + LOCAL_HEADER.size + len(encoded) + len(extra) + 4
    pad = -start % alignment
    extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
    version = _version(size, compress_size, header)
    local = LOCAL_HEADER.pack(
        LOCAL_SIGNATURE, version, _flags(compress_size), method, 0, 0, 0, 0, 0, len(encoded), len(extra)
    )
    return local + encoded + extra


def data_descriptor(*, crc: int, size: int, compress_size: int, header: int) -> bytes:
    """The data descriptor after a record's data, as miniz writes it (none for an empty record). Local."""
    if not compress_size:
        return b""
    fmt = "<IIQQ" if header >= _U32 or size >= _U32 else "<IIII"
    return struct.pack(fmt, 0x08074B50, crc, compress_size, size)


def central_entry(encoded: bytes, *, size: int, compress_size: int, header: int, crc: int, method: int = 0) -> bytes:
    """A record's central directory header (zip64 fields where needed). Local."""
    fields = b""
    if size >= _U32:
        fields += struct.pack("<Q", size)
    if compress_size >= _U32:
        fields += struct.pack("<Q", compress_size)
    if header >= _U32:
        fields += struct.pack("<Q", header)
    extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
    version = _version(size, compress_size, header)
    entry = _CENTRAL.pack(
        0x02014B50,
        version,
        version,
        _flags(compress_size),
        method,
        0,
        0,
        crc,
        min(compress_size, _U32),
        min(size, _U32),
        len(encoded),
        len(extra),
        0,
        0,
        0,
        0,
        min(header, _U32),
    )
    return entry + encoded + extra


def end_records(*, central_offset: int, central_size: int, count: int) -> bytes:
    """What follows the central directory: torch's writer (miniz with its zip64 flag) always ends with the zip64 end
    record and its locator, then the classic end record. Local."""
    end = central_offset + central_size
    tail = _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, central_size, central_offset)
    tail += _LOCATOR64.pack(0x07064B50, 0, end, 1)
    tail += _EOCD.pack(
        0x06054B50,
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(central_size, _U32),
        min(central_offset, _U32),
        0,
    )
    return tail


class ZipWriter:
    """Writes a zip archive with the layout of torch's writer to a file descriptor, at explicit offsets."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.offset = 0
        self._central: list[bytes] = []

    def add(
        self, name: str, *, size: int, compress_size: int, crc: int, method: int, fill: Callable[[int], None]
    ) -> None:
        """Add a record whose ``compress_size`` data bytes ``fill(data_offset)`` writes; its CRC-32 is ``crc``."""

        def filled(offset: int) -> int:
            fill(offset)
            return crc

        self.add_streamed(name, size=size, compress_size=compress_size, method=method, fill=filled)

    def add_streamed(
        self, name: str, *, size: int, compress_size: int | None = None, method: int = 0, fill: Callable[[int], int]
    ) -> None:
        """Add a record whose data ``fill(data_offset)`` writes, returning the CRC-32 of what it wrote.

        ``size`` must be known beforehand (the local header precedes the data); ``compress_size``
        defaults to it (a stored record).
        """
        compress_size = size if compress_size is None else compress_size
        encoded = name.encode("utf-8")
        header = self.offset
        head = local_header(encoded, size=size, compress_size=compress_size, header=header, method=method)
        write_all(self._fd, head, header)
        data_offset = header + len(head)
        crc = fill(data_offset)
        end = data_offset + compress_size
        descriptor = data_descriptor(crc=crc, size=size, compress_size=compress_size, header=header)
        if descriptor:
            write_all(self._fd, descriptor, end)
        self.offset = end + len(descriptor)
        entry = central_entry(encoded, size=size, compress_size=compress_size, header=header, crc=crc, method=method)
        self._central.append(entry)

    def add_bytes(self, name: str, data: bytes) -> None:
        """Add a stored record holding ``data``."""
        self.add(
            name,
            size=len(data),
            compress_size=len(data),
            crc=zlib.crc32(data),
            method=0,
            fill=lambda offset: write_all(self._fd, data, offset),
        )

    def finish(self) -> int:
        """Write the central directory and the (zip64) end records; return the archive's size."""
        cd_offset = self.offset
        central = b"".join(self._central)
        write_all(self._fd, central, cd_offset)
        tail = end_records(central_offset=cd_offset, central_size=len(central), count=len(self._central))
        end = cd_offset + len(central)
        write_all(self._fd, tail, end)
        os.ftruncate(self._fd, end + len(tail))
        return end + len(tail)
