"""Writing a new torch zip checkpoint whose storages are byte ranges of another file (a ``.safetensors``).

The structure is pickled as ``torch.save`` pickles it (persistent ids naming storage records, the
same rebuild functions), and each storage record is a byte range copied file to file, so
``torch.load(weights_only=True)`` reads the result as if ``torch.save`` had written it and no
tensor is deserialized on the way.
"""

from __future__ import annotations

import mmap
import secrets
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch

from .._core.location import local_path
from .._core.torch_compat.private import storage_class_for
from .._foreign.safetensors_read import DTYPES, read_safetensors_header
from .._format.archive import ArchiveContents, StorageInfo
from .._format.pickle_write import dump_pickle
from .._format.zip_write import ZipWriter, copy_range

__all__ = ["RawTensors", "read_safetensors_meta", "write_archive"]

_ARCHIVE: Final = "archive"
_CHUNK: Final = 16 << 20


@dataclass
class RawTensors:
    """Meta tensors standing for byte ranges of a file, ready to be pickled into a new archive."""

    contents: ArchiveContents  # storages by key, and the meta storage -> key map dump_pickle needs
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, str]
    ranges: dict[str, tuple[int, int]] = field(default_factory=dict)  # storage key -> (offset, nbytes)


def read_safetensors_meta(path: Path) -> RawTensors:
    """A ``.safetensors`` file's tensors as meta tensors, each with its own storage. Local; reads the header only."""
    data_start, entries, metadata = read_safetensors_header(path)
    contents = ArchiveContents(path, _ARCHIVE, [], 0, None, {})
    raw = RawTensors(contents, {}, metadata)
    for i, (name, entry) in enumerate(sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0])):
        dtype = DTYPES[entry["dtype"]]
        tensor = torch.empty(entry["shape"], dtype=dtype, device="meta")
        cls, storage_dtype = storage_class_for(dtype)
        begin, end = entry["data_offsets"]
        nbytes = end - begin
        numel = nbytes // storage_dtype.itemsize
        key = str(i)
        info = StorageInfo(key, storage_dtype, "cpu", numel, nbytes, ("storage", cls, key, "cpu", numel))
        contents.register(tensor.untyped_storage(), info)
        raw.tensors[name] = tensor
        raw.ranges[key] = (data_start + begin, nbytes)
    return raw


def _crc(view: memoryview, begin: int, nbytes: int) -> int:
    crc = 0
    for start in range(begin, begin + nbytes, _CHUNK):
        crc = zlib.crc32(view[start : min(start + _CHUNK, begin + nbytes)], crc)
    return crc


def write_archive(
    raw: RawTensors, obj: Any, fd: int, progress: Callable[[int, int], None] | None = None
) -> tuple[int, bytes]:
    """Write ``obj`` (built from ``raw.tensors``) as a torch zip checkpoint to ``fd``; ``(size, data.pkl)``. Local.

    Records come in ``torch.save``'s order, each storage's bytes copied from ``raw.contents.path``;
    their CRC32 is computed from the source (the only pass over the bytes in user space, in two worker
    threads that run ahead of the copy).
    """
    pickled = dump_pickle(obj, raw.contents)
    writer = ZipWriter(fd)
    writer.add_bytes(f"{_ARCHIVE}/data.pkl", pickled)
    writer.add_bytes(f"{_ARCHIVE}/.format_version", b"1")
    writer.add_bytes(f"{_ARCHIVE}/.storage_alignment", b"64")
    writer.add_bytes(f"{_ARCHIVE}/byteorder", b"little")
    total = sum(n for _, n in raw.ranges.values())
    done = 0
    source = local_path(raw.contents.path, "write_archive")
    with open(source, "rb") as src:
        size = source.stat().st_size
        with mmap.mmap(src.fileno(), size, access=mmap.ACCESS_READ) as mapped:  # a header at least: never empty
            view = memoryview(mapped)
            # the CRC32 of each record is computed in worker threads (zlib releases the GIL) while the
            # main thread copies the records before it in the kernel: the two passes overlap
            with ThreadPoolExecutor(max_workers=2) as pool:
                crcs = [pool.submit(_crc, view, begin, nbytes) for begin, nbytes in raw.ranges.values()]
                try:
                    for (key, (begin, nbytes)), crc in zip(raw.ranges.items(), crcs):

                        def fill(offset: int, begin: int = begin, nbytes: int = nbytes) -> None:
                            if nbytes:
                                copy_range(src.fileno(), fd, begin, offset, nbytes)

                        writer.add(
                            f"{_ARCHIVE}/data/{key}",
                            size=nbytes,
                            compress_size=nbytes,
                            crc=crc.result(),
                            method=0,
                            fill=fill,
                        )
                        done += nbytes
                        if progress is not None:
                            progress(done, total)
                finally:
                    for future in crcs:
                        future.cancel()
                    pool.shutdown(wait=True)
                    view.release()
    writer.add_bytes(f"{_ARCHIVE}/version", b"3\n")
    writer.add_bytes(f"{_ARCHIVE}/.data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
    return writer.finish(), pickled
