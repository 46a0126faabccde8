"""Writing ``.safetensors`` files with torch alone, copying tensor bytes straight from a torch zip checkpoint.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's
``dtype``, ``shape`` and ``data_offsets``, plus ``__metadata__`` of strings) padded with spaces to
8 bytes, then the raw little-endian bytes. A torch zip checkpoint stores each storage as a record
of the same raw bytes, so a contiguous tensor is a byte range of its storage's record: it is copied
file to file (``copy_file_range``) and never deserialized.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.location import local_path
from .._foreign.safetensors_read import DTYPES
from .._format.archive import ArchiveContents
from .._format.records import Record
from .._format.zip_write import copy_range, write_all
from .._store.ranges import open_binary

__all__ = ["DTYPE_CODES", "safetensors_header", "write_safetensors_from_archive"]

DTYPE_CODES: Final[dict[torch.dtype, str]] = {dtype: code for code, dtype in DTYPES.items()}
_ALIGN: Final = 8


def safetensors_header(entries: Mapping[str, tuple[torch.dtype, list[int], int]], metadata: Mapping[str, str]) -> bytes:
    """The length prefix and the space-padded JSON header for ``entries`` (name -> dtype, shape, nbytes), laid
    out in the given order, each tensor right after the previous one."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, (dtype, shape, nbytes) in entries.items():
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return len(raw).to_bytes(8, "little") + raw


def _byteorder(contents: ArchiveContents) -> str:
    name = f"{contents.archive_name}/byteorder"
    if not any(r.name == name for r in contents.records):
        return "little"  # torch.save wrote no byteorder record before 1.12: little-endian machines only
    try:
        with open_binary(contents.path) as f, zipfile.ZipFile(f) as zf:
            return zf.read(name).decode("ascii", "replace").strip()
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise CheckpointCorruptError(
            f"checkpoint {str(contents.path)!r}: its {name!r} record is damaged ({err}); resume from an earlier checkpoint"
        ) from err


def _source_range(
    contents: ArchiveContents, records: Mapping[str, Record], key: str, t: torch.Tensor
) -> tuple[int, int]:
    """Where ``t``'s bytes lie in the source file: (offset, nbytes). Refuses what is not a plain byte range."""
    src = repr(str(contents.path))
    info = contents.storage_of(t)
    if info is None or t.layout != torch.strided or t.is_quantized or t.is_nested:
        raise NotACheckpointError(f"{src}: tensor {key!r} ({t.layout}) has no plain storage to copy into safetensors")
    if t.dtype not in DTYPE_CODES:
        raise NotACheckpointError(
            f"{src}: tensor {key!r} has dtype {t.dtype}, which safetensors cannot hold; convert to pt instead"
        )
    if not t.is_contiguous():
        raise NotACheckpointError(
            f"{src}: tensor {key!r} is a non-contiguous view (shape {list(t.shape)}, stride {list(t.stride())}) and "
            "safetensors stores contiguous tensors only; load the file, call .contiguous() on it and save it again, "
            "then convert"
        )
    record = records.get(f"{contents.archive_name}/data/{info.key}")
    begin = int(t.storage_offset()) * t.element_size()
    nbytes = t.numel() * t.element_size()
    if record is None or record.compress_type != zipfile.ZIP_STORED or begin + nbytes > record.file_size:
        raise NotACheckpointError(
            f"{src}: the bytes of tensor {key!r} are not a stored record of the archive (missing, compressed or "
            "short); re-save the file with torch.save, then convert"
        )
    return record.data_offset + begin, nbytes


def write_safetensors_from_archive(
    contents: ArchiveContents, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str], fd: int
) -> int:
    """Write ``tensors`` (meta tensors of ``contents``, already under their output names) as a safetensors
    file to ``fd``, copying their bytes from the archive; return the file size. Local.

    Tensors are laid out by decreasing element size, then name (as the reference writer does), so
    every tensor starts at a multiple of its element size.
    """
    if _byteorder(contents) != "little":
        raise NotACheckpointError(
            f"{str(contents.path)!r} was saved on a big-endian machine; safetensors is little-endian: "
            "load it with torch.load and save it with the safetensors package instead"
        )
    records = {r.name: r for r in contents.records}
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    ranges = {k: _source_range(contents, records, k, tensors[k]) for k in order}
    entries = {k: (tensors[k].dtype, list(tensors[k].shape), ranges[k][1]) for k in order}
    head = safetensors_header(entries, metadata)
    write_all(fd, head, 0)
    offset = len(head)
    with open(local_path(contents.path, "write_safetensors"), "rb") as src:
        for k in order:
            begin, nbytes = ranges[k]
            if nbytes:
                copy_range(src.fileno(), fd, begin, offset, nbytes)
            offset += nbytes
    os.ftruncate(fd, offset)
    return offset
