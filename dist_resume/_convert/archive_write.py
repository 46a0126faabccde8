"""Rewriting a torch zip checkpoint: a new ``data.pkl``, every other record copied byte for byte.

The output has the layout torch's own writer (miniz, via ``PyTorchStreamWriter``) produces, which
``torch.load`` relies on when it computes storage offsets itself (``mmap``, ``map_location="meta"``):
records in the source order, each local header padded with an ``FB`` extra field so the data
starts on a 64-byte boundary, a data descriptor after every non-empty record, zip64 fields where
sizes or offsets reach 4 GiB. Record data moves with ``copy_file_range`` (inside the kernel, no
user-space buffer) and keeps its recorded CRC32, so damage in the source stays detectable.
"""

from __future__ import annotations

import io
import os
import pickle
import struct
import zlib
from collections.abc import Callable
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.torch_compat import tensor_reduction
from .._format.archive import ArchiveContents
from .._format.records import LOCAL_HEADER, LOCAL_SIGNATURE, Record

__all__ = ["dump_pickle", "rewrite_archive", "ZipWriter", "copy_range", "write_all"]

Progress = Callable[[int, int], None]

_ALIGNMENT: Final = 64  # torch's storage alignment (torch.utils.serialization.config.save.storage_alignment)
_U32: Final = 0xFFFFFFFF
_COPY_CHUNK: Final = 64 << 20
_FLAG_UTF8: Final = 0x0800
_FLAG_DESCRIPTOR: Final = 0x0008
_CENTRAL: Final = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory header, 46 bytes
_EOCD: Final = struct.Struct("<IHHHHIIH")
_EOCD64: Final = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64: Final = struct.Struct("<IIQI")


class _StorageRef:
    """Pickled as the persistent id of a saved storage, so the new data.pkl points at the old records."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _MetaPickler(pickle.Pickler):
    """Pickles a structure from :func:`read_archive` the way ``torch.save`` pickles the real one."""

    def __init__(self, file: io.BytesIO, contents: ArchiveContents) -> None:
        super().__init__(file, protocol=2)  # torch.save's default protocol
        self._contents = contents

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _StorageRef else None

    def reducer_override(self, obj: Any) -> Any:
        # Parameters reduce to _rebuild_parameter(param.data, ...), and param.data comes back here
        if not isinstance(obj, torch.Tensor) or type(obj) is torch.nn.Parameter:
            return NotImplemented
        info = self._contents.storage_of(obj)
        if info is None:
            return NotImplemented  # saved without storage (a meta tensor): torch's own reduction is right
        if obj.layout != torch.strided or obj.is_quantized or obj.is_nested:
            raise NotACheckpointError(f"cannot rewrite a {obj.layout} tensor without loading it")
        return tensor_reduction(obj, _StorageRef(info.pid), info.dtype)


def dump_pickle(obj: Any, contents: ArchiveContents) -> bytes:
    """Pickle ``obj`` (built from ``contents.obj``) as a new ``data.pkl`` for the same storage records."""
    buf = io.BytesIO()
    _MetaPickler(buf, contents).dump(obj)
    return buf.getvalue()


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _copy_range(src: int, dst: int, src_offset: int, dst_offset: int, count: int) -> None:
    """Copy ``count`` bytes between files at explicit offsets, in the kernel when it can."""
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
            _write_all(dst, chunk, dst_offset)
            n = len(chunk)
        if n == 0:
            raise CheckpointCorruptError("the source checkpoint ended in the middle of a record (was it truncated?)")
        src_offset, dst_offset, count = src_offset + n, dst_offset + n, count - n


write_all = _write_all  # public names for the writers next to this one; tests patch the private ones
copy_range = _copy_range


class ZipWriter:
    """Writes a zip archive with the layout of torch's writer to a file descriptor, at explicit offsets."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.offset = 0
        self._central: list[bytes] = []

    def add(
        self, name: str, *, size: int, compress_size: int, crc: int, method: int, fill: Callable[[int], None]
    ) -> None:
        """Add a record whose ``compress_size`` data bytes ``fill(data_offset)`` writes."""
        encoded = name.encode("utf-8")
        header = self.offset
        zip64 = size >= _U32 or compress_size >= _U32 or header >= _U32
        fields = b""
        if size >= _U32 or compress_size >= _U32:
            fields += struct.pack("<QQ", size, compress_size)
        if header >= _U32:
            fields += struct.pack("<Q", header)
        local_extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        start = header + LOCAL_HEADER.size + len(encoded) + len(local_extra) + 4
        pad = -start % _ALIGNMENT
        local_extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
        flags = _FLAG_UTF8 | (_FLAG_DESCRIPTOR if compress_size else 0)
        version = 45 if zip64 else 0
        local = LOCAL_HEADER.pack(
            LOCAL_SIGNATURE, version, flags, method, 0, 0, 0, 0, 0, len(encoded), len(local_extra)
        )
        _write_all(self._fd, local + encoded + local_extra, header)
        data_offset = header + len(local) + len(encoded) + len(local_extra)
        fill(data_offset)
        end = data_offset + compress_size
        if compress_size:  # the data descriptor, as miniz writes it
            big = header >= _U32 or size >= _U32
            fmt = "<IIQQ" if big else "<IIII"
            descriptor = struct.pack(fmt, 0x08074B50, crc, compress_size, size)
            _write_all(self._fd, descriptor, end)
            end += len(descriptor)
        self.offset = end
        central_fields = b""
        if size >= _U32:
            central_fields += struct.pack("<Q", size)
        if compress_size >= _U32:
            central_fields += struct.pack("<Q", compress_size)
        if header >= _U32:
            central_fields += struct.pack("<Q", header)
        central_extra = struct.pack("<HH", 1, len(central_fields)) + central_fields if central_fields else b""
        self._central.append(
            _CENTRAL.pack(
                0x02014B50,
                version,
                version,
                flags,
                method,
                0,
                0,
                crc,
                min(compress_size, _U32),
                min(size, _U32),
                len(encoded),
                len(central_extra),
                0,
                0,
                0,
                0,
                min(header, _U32),
            )
            + encoded
            + central_extra
        )

    def add_bytes(self, name: str, data: bytes) -> None:
        self.add(
            name,
            size=len(data),
            compress_size=len(data),
            crc=zlib.crc32(data),
            method=0,
            fill=lambda offset: _write_all(self._fd, data, offset),
        )

    def finish(self) -> int:
        """Write the central directory (zip64 when needed); return the archive's size."""
        cd_offset = self.offset
        central = b"".join(self._central)
        _write_all(self._fd, central, cd_offset)
        end = cd_offset + len(central)
        count = len(self._central)
        tail = b""
        if count >= 0xFFFF or cd_offset >= _U32 or len(central) >= _U32:
            tail += _EOCD64.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, len(central), cd_offset)
            tail += _LOCATOR64.pack(0x07064B50, 0, end, 1)
        tail += _EOCD.pack(
            0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(len(central), _U32), min(cd_offset, _U32), 0
        )
        _write_all(self._fd, tail, end)
        os.ftruncate(self._fd, end + len(tail))
        return end + len(tail)


def rewrite_archive(contents: ArchiveContents, new_pickle: bytes, dst_fd: int, progress: Progress | None = None) -> int:
    """Write ``contents``' archive to ``dst_fd`` with ``new_pickle`` as its data.pkl; return the size written.

    Local. Every other record is copied byte for byte with its CRC32, in the source's order.
    """
    total = sum(r.compress_size for r in contents.records)
    done = 0
    writer = ZipWriter(dst_fd)
    with open(contents.path, "rb") as src:
        for record in contents.records:
            if record.name == contents.pickle_record:
                writer.add_bytes(record.name, new_pickle)
            else:
                writer.add(
                    record.name,
                    size=record.file_size,
                    compress_size=record.compress_size,
                    crc=record.crc,
                    method=record.compress_type,
                    fill=_copier(src.fileno(), dst_fd, record, done, total, progress),
                )
            done += record.compress_size
            if progress is not None:
                progress(done, total)
        return writer.finish()


def _copier(
    src: int, dst: int, record: Record, done: int, total: int, progress: Progress | None
) -> Callable[[int], None]:
    def fill(offset: int) -> None:
        copied = 0
        while copied < record.compress_size:
            n = min(_COPY_CHUNK, record.compress_size - copied)
            _copy_range(src, dst, record.data_offset + copied, offset + copied, n)
            copied += n
            if progress is not None:
                progress(done + copied, total)

    return fill
