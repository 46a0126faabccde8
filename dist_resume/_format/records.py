"""The records of a torch zip checkpoint, without unpickling anything.

:func:`read_records` reads the central directory and every local header (no record data) and checks what torch's C++
reader would trust blindly; :mod:`~dist_resume._format.zip_verify` checks the archive's structure and the CRC-32 of
every record, which ``torch.load`` never does.
"""

from __future__ import annotations

import io
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, Final

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.location import Location, RemotePath
from .._store.ranges import open_binary, prefetch
from .safe_open import reading
from .sniff import FileKind, check_file, file_kind

__all__ = [
    "LOCAL_HEADER",
    "LOCAL_SIGNATURE",
    "Record",
    "read_records",
    "check_zip_bytes",
    "check_zip_stream",
]

LOCAL_HEADER: Final = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
LOCAL_SIGNATURE: Final = 0x04034B50
_ENDS: Final = 256 << 10  # an object's directory is read with its first and last bytes (data.pkl, the directory)
_HEADER_READ: Final = 1024  # a local header, its name and (torch's alignment padding) its extra field


@dataclass(frozen=True, slots=True)
class Record:
    """One member of the archive, as its central directory and local header describe it."""

    name: str  # full name, e.g. "archive/data/0"
    header_offset: int
    data_offset: int
    compress_size: int
    file_size: int
    crc: int
    compress_type: int


def _name(path: Location) -> str:
    return repr(str(path))


def _read_directory(p: Location, size: int) -> list[Record]:
    """Every record from the central directory and its local header: a local file read in place; an object by
    ranges, its two ends in one batch and then every local header in another."""
    if not isinstance(p, RemotePath):
        with zipfile.ZipFile(p) as zf, open(p, "rb", buffering=0) as f:  # unbuffered: reads only the headers
            return [_record(f, info, size) for info in zf.infolist()]
    with open_binary(p, window=_ENDS) as f:
        prefetch(f, [(0, _ENDS), (size - _ENDS, size)])
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
        prefetch(f, [(i.header_offset, i.header_offset + LOCAL_HEADER.size + _HEADER_READ) for i in infos])
        return [_record(f, info, size) for info in infos]


def read_records(path: Location) -> tuple[str, list[Record]]:
    """The archive name and the records of a torch zip checkpoint, in file order. Reads no record data.

    Reads the central directory and each record's local header only, and checks what torch's C++
    reader would trust blindly: every record's header and data lie inside the file, its sizes are
    consistent, its name decodes and matches its local header, all records share one folder, and
    ``data.pkl`` is present. Raises :class:`CheckpointError` subclasses for a missing, empty,
    truncated, damaged, legacy or foreign file.
    """
    p = check_file(path)
    if file_kind(p) is FileKind.LEGACY:
        raise NotACheckpointError(
            f"{_name(p)} uses torch's legacy (pre-1.6) format, which has no records to copy or inspect; "
            "re-save it once: torch.save(torch.load(path, weights_only=True), new_path)"
        )
    try:
        with reading(p):  # the file removed since check_file (a writer's rotation): CheckpointNotFoundError
            records = _read_directory(p, p.stat().st_size)
    except (zipfile.BadZipFile, UnicodeDecodeError, NotImplementedError, ValueError, struct.error, EOFError) as err:
        # zipfile raises UnicodeDecodeError for a name flagged UTF-8 that is not, NotImplementedError for
        # a "zip file version" it does not know: both are damage in a file torch.save wrote
        raise CheckpointCorruptError(
            f"checkpoint {_name(p)} is damaged or truncated (zip directory: {type(err).__name__}: "
            f"{str(err)[:200]}); most likely a save that was interrupted or a damaged copy: resume from an "
            "earlier checkpoint"
        ) from err
    if not records:
        raise NotACheckpointError(f"{_name(p)} is an empty zip archive, not a checkpoint written by torch.save")
    archive_name, slash, _ = records[0].name.partition("/")
    if not slash or not archive_name or any(not r.name.startswith(archive_name + "/") for r in records):
        raise NotACheckpointError(
            f"{_name(p)} is a zip archive but not one written by torch.save (records are not in one folder); "
            "point to a .pt/.pth file saved with torch.save"
        )
    names = {r.name for r in records}
    if f"{archive_name}/data.pkl" not in names:
        what = (
            "a TorchScript archive (torch.jit.save); load it with torch.jit.load"
            if f"{archive_name}/constants.pkl" in names
            else "a zip archive without data.pkl"
        )
        raise NotACheckpointError(
            f"{_name(p)} is {what}, not a checkpoint written by torch.save; point to a .pt/.pth file saved with "
            "torch.save"
        )
    return archive_name, records


def check_zip_bytes(data: bytes, what: str) -> None:
    """Raise :class:`CheckpointCorruptError` unless ``data`` (an in-memory torch.save archive, e.g. one tensor of a
    DCP ``.distcp`` file) passes the checks :func:`read_records` makes, before torch's C++ reader trusts its sizes."""
    check_zip_stream(io.BytesIO(data), len(data), what)


def check_zip_stream(f: Any, size: int, what: str) -> list[Record]:
    """:func:`check_zip_bytes` of a seekable stream of ``size`` bytes (a view of one entry of a larger file), read in
    place: only the directory and the local headers are read; its records. The stream's position is left anywhere."""
    try:
        with zipfile.ZipFile(f) as zf:
            return [_record(f, info, size) for info in zf.infolist()]
    except (zipfile.BadZipFile, UnicodeDecodeError, NotImplementedError, ValueError, struct.error, EOFError) as err:
        raise CheckpointCorruptError(
            f"{what} is damaged ({type(err).__name__}: {str(err)[:200]}); resume from an earlier checkpoint"
        ) from err


# deflate cannot expand data more than about 1032:1; a larger uncompressed size is a damaged field
_MAX_DEFLATE_RATIO: Final = 1032
# general-purpose flag bits 0 (encrypted) and 6 (strong encryption): zipfile raises RuntimeError, torch's reader
# "unsupported encryption"; a torch.save archive has neither, so either bit is a damaged header
_ENCRYPTED: Final = 0x41


def _record(f: Any, info: zipfile.ZipInfo, size: int) -> Record:
    """One record, checked against the file (raises zipfile.BadZipFile for anything out of bounds)."""
    name = info.filename
    if not 0 <= info.header_offset <= size - LOCAL_HEADER.size:
        raise zipfile.BadZipFile(f"record {name!r} has its header at offset {info.header_offset}, outside the file")
    if "\x00" in name or info.compress_size < 0 or info.file_size < 0:
        raise zipfile.BadZipFile(f"record {name!r} has a damaged name or size")
    f.seek(info.header_offset)
    head = f.read(LOCAL_HEADER.size)
    if len(head) < LOCAL_HEADER.size or LOCAL_HEADER.unpack(head)[0] != LOCAL_SIGNATURE:
        raise zipfile.BadZipFile(f"no local header for {name!r} at offset {info.header_offset}")
    flags, name_len, extra_len = LOCAL_HEADER.unpack(head)[2], *LOCAL_HEADER.unpack(head)[9:11]
    if (info.flag_bits | flags) & _ENCRYPTED:
        raise zipfile.BadZipFile(f"record {name!r} is marked encrypted, which torch.save never writes")
    local_name = f.read(name_len)
    if local_name.decode("utf-8" if flags & 0x800 else "cp437") != info.orig_filename:
        raise zipfile.BadZipFile(f"record {name!r} has another name in its local header ({local_name[:80]!r})")
    data_offset = info.header_offset + LOCAL_HEADER.size + name_len + extra_len
    if data_offset + info.compress_size > size:
        raise zipfile.BadZipFile(f"record {name!r} runs past the end of the file")
    if info.compress_type == zipfile.ZIP_STORED:
        if info.file_size != info.compress_size:
            raise zipfile.BadZipFile(
                f"record {name!r} is stored but its sizes differ ({info.compress_size} and {info.file_size} bytes)"
            )
    elif info.compress_type == zipfile.ZIP_DEFLATED:
        if info.file_size > _MAX_DEFLATE_RATIO * info.compress_size + 64:
            raise zipfile.BadZipFile(
                f"record {name!r} claims {info.file_size} bytes from {info.compress_size} compressed bytes"
            )
    else:  # torch.save stores records uncompressed; torch's reader inflates deflate and nothing else
        raise zipfile.BadZipFile(
            f"record {name!r} uses compression method {info.compress_type}, which torch cannot read"
        )
    return Record(
        name, info.header_offset, data_offset, info.compress_size, info.file_size, info.CRC, info.compress_type
    )
