"""A local file's byte ranges read with positional reads, straight into the memory that keeps them.

A striped resume (:mod:`~dist_resume._checkpoint.striped`) reads a local torch zip the way
:class:`~dist_resume._format.ranged.RangedArchive` reads an object on a store: the structure first, then each tensor's
bytes into its destination. :class:`LocalRanges` is that reader for a local file: no mapping and no read-ahead buffer,
one ``readinto`` syscall into the destination's own bytes (:meth:`LocalRanges.fill`), or into one reused window
(:meth:`LocalRanges.chunks`); what it reads is what ``/proc/self/io`` counts. :func:`check_record_crc` checks one
record's CRC-32 through it, for a verification split across ranks.
"""

from __future__ import annotations

import ctypes
import io
import zlib
from collections.abc import Iterator

import torch

from .._core.errors import CheckpointCorruptError
from .._core.location import Location
from .records import Record
from .zip_verify import ArchiveFinding, FindingKind, integrity_failure

__all__ = ["LocalRanges", "read_at", "check_record_crc"]


def read_at(f: io.FileIO, start: int, buffer: memoryview) -> int:
    """One read syscall of ``len(buffer)`` bytes at ``start`` of ``f`` into ``buffer``; the bytes read (fewer at the
    end of the file). Local; the one place a :class:`LocalRanges` reads (a benchmark may throttle it)."""
    f.seek(start)
    return f.readinto(buffer) or 0


def _writable(out: torch.Tensor) -> memoryview:
    """The bytes of the contiguous uint8 CPU tensor ``out`` as a writable memoryview (no numpy needed)."""
    if out.device.type != "cpu" or out.dtype != torch.uint8 or not out.is_contiguous():
        raise ValueError("positional reads land in a contiguous uint8 CPU tensor")
    return memoryview((ctypes.c_ubyte * out.numel()).from_address(out.data_ptr())).cast("B")


class LocalRanges:
    """A local file opened for positional reads, through a window of ``window`` bytes where the bytes cannot land
    in place. Local; close it (or use ``with``) to let the file and the window go."""

    def __init__(self, path: Location, *, window: int) -> None:
        self.path = path
        self.window = max(1, window)
        self._file: io.FileIO | None = io.FileIO(path, "r")
        self._buffer: torch.Tensor | None = None

    def __enter__(self) -> LocalRanges:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._buffer = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _opened(self) -> io.FileIO:
        if self._file is None:
            self._file = io.FileIO(self.path, "r")
        return self._file

    def fill(self, start: int, out: torch.Tensor) -> None:
        """Bytes ``[start, start + len(out))`` of the file into the flat uint8 CPU tensor ``out``, read straight into
        it; a file that ends first raises :class:`CheckpointCorruptError`."""
        if not out.numel():
            return
        view, done = _writable(out), 0
        f = self._opened()
        while done < len(view):
            n = read_at(f, start + done, view[done:])
            if n <= 0:
                raise CheckpointCorruptError(
                    f"checkpoint {str(self.path)!r} is damaged or was truncated while it was read: {len(view) - done} "
                    f"of the {len(view)} bytes at offset {start} are past its end; resume from an earlier checkpoint"
                )
            done += n

    def chunks(self, start: int, end: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` one window at a time (each view valid until the next)."""
        if self._buffer is None:
            self._buffer = torch.empty(self.window, dtype=torch.uint8)
        for begin in range(start, end, self.window):
            n = min(self.window, end - begin)
            self.fill(begin, self._buffer[:n])
            yield _writable(self._buffer)[:n]


def check_record_crc(ranges: LocalRanges, record: Record) -> None:
    """Raise :class:`CheckpointCorruptError` unless the stored ``record``'s bytes match its CRC-32. Local; reads the
    record once, through the window."""
    crc = 0
    for piece in ranges.chunks(record.data_offset, record.data_offset + record.compress_size):
        crc = zlib.crc32(piece, crc)
    if crc != record.crc:
        finding = ArchiveFinding(
            record.name,
            f"CRC32 mismatch (recorded {record.crc:#010x}, data {crc:#010x}): its bytes changed",
            FindingKind.CRC_MISMATCH,
        )
        raise integrity_failure(
            repr(str(ranges.path)),
            [finding],
            "the file was damaged after it was written (disk, copy or transfer): resume from an earlier checkpoint "
            "or copy it again",
        )
