"""Rewriting a torch zip checkpoint: a new ``data.pkl``, every other record copied byte for byte.

The output has the layout of torch's own writer (:class:`ZipWriter`): records in the source order.
Record data moves with ``copy_file_range`` (inside the kernel, no user-space buffer) and keeps its
recorded CRC32, so damage in the source stays detectable.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final

from .._core.location import local_path
from .._format.archive import ArchiveContents
from .._format.records import Record
from .._format.zip_write import ZipWriter
from .._format.zip_write import copy_range as _copy_range  # module-level, so tests can slow it down

__all__ = ["rewrite_archive"]

Progress = Callable[[int, int], None]

_COPY_CHUNK: Final = 64 << 20


def rewrite_archive(contents: ArchiveContents, new_pickle: bytes, dst_fd: int, progress: Progress | None = None) -> int:
    """Write ``contents``' archive to ``dst_fd`` with ``new_pickle`` as its data.pkl; return the size written.

    Local. Every other record is copied byte for byte with its CRC32, in the source's order.
    """
    total = sum(r.compress_size for r in contents.records)
    done = 0
    writer = ZipWriter(dst_fd)
    with open(local_path(contents.path, "rewrite_archive"), "rb") as src:
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
