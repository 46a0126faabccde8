"""The records of a torch zip checkpoint and their integrity, without unpickling anything.

:func:`read_records` reads the central directory and every local header (no record data);
:func:`verify_archive` checks the archive's structure and the CRC-32 of every record, which
``torch.load`` never does.
"""

from __future__ import annotations

import io
import mmap
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.text import preview
from .._core.types import PathLike
from .sniff import FileKind, check_file, file_kind

__all__ = [
    "LOCAL_HEADER",
    "LOCAL_SIGNATURE",
    "Record",
    "FindingKind",
    "ArchiveFinding",
    "read_records",
    "check_zip_bytes",
    "check_zip_stream",
    "verify_zip",
]

LOCAL_HEADER: Final = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
LOCAL_SIGNATURE: Final = 0x04034B50
_CRC_CHUNK: Final = 16 << 20


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


class FindingKind(Enum):
    """What kind of integrity problem an :class:`ArchiveFinding` reports."""

    UNREADABLE = "unreadable"  # the archive's structure cannot be read (truncated, damaged directory)
    DUPLICATE_RECORD = "duplicate_record"
    NO_VERSION = "no_version"  # the 'version' record torch.save always writes is absent
    CRC_MISMATCH = "crc_mismatch"
    UNDECOMPRESSABLE = "undecompressable"  # a compressed record that does not inflate or fails its CRC


@dataclass(frozen=True, slots=True)
class ArchiveFinding:
    """One integrity problem: the record it concerns (None for the archive as a whole) and what is wrong."""

    record: str | None
    problem: str
    kind: FindingKind

    def __str__(self) -> str:
        return f"{self.record}: {self.problem}" if self.record else self.problem


def _name(path: Path) -> str:
    return repr(str(path))


def read_records(path: PathLike) -> tuple[str, list[Record]]:
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
    size = p.stat().st_size
    try:
        with zipfile.ZipFile(p) as zf, open(p, "rb", buffering=0) as f:  # unbuffered: reads only the headers
            infos = zf.infolist()
            records = [_record(f, info, size) for info in infos]
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


def check_zip_stream(f: Any, size: int, what: str) -> None:
    """:func:`check_zip_bytes` of a seekable stream of ``size`` bytes (a view of one entry of a larger file), read in
    place: only the directory and the local headers are read. The stream's position is left anywhere."""
    try:
        with zipfile.ZipFile(f) as zf:
            for info in zf.infolist():
                _record(f, info, size)
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


def verify_zip(
    path: PathLike, *, strict: bool = True, progress: Callable[[int, int], None] | None = None
) -> list[ArchiveFinding]:
    """Check one torch zip file's structure and the CRC-32 of every record (the public face is ``verify_archive``)."""
    p = Path(path)
    try:
        archive_name, records = read_records(p)
    except CheckpointCorruptError as err:
        findings = [ArchiveFinding(None, str(err), FindingKind.UNREADABLE)]
    else:
        findings = _structure_findings(archive_name, records) + _crc_findings(p, records, progress)
    if findings and strict:
        raise integrity_failure(
            _name(p),
            findings,
            "the file was damaged after it was written (disk, copy or "
            "transfer): resume from an earlier checkpoint or copy it again",
        )
    return findings


def integrity_failure(name: str, findings: list[ArchiveFinding], advice: str) -> CheckpointCorruptError:
    """The one refusal for a checkpoint whose integrity check found ``findings``: the first three, then ``advice``."""
    shown = preview(findings, 3, sep="; ", quote=False)
    return CheckpointCorruptError(f"checkpoint {name} failed its integrity check: {shown}; {advice}")


def _structure_findings(archive_name: str, records: list[Record]) -> list[ArchiveFinding]:
    findings = []
    seen: set[str] = set()
    for r in records:
        if r.name in seen:
            findings.append(ArchiveFinding(r.name, "appears twice in the archive", FindingKind.DUPLICATE_RECORD))
        seen.add(r.name)
    if f"{archive_name}/version" not in seen:
        findings.append(ArchiveFinding(None, "the archive has no 'version' record", FindingKind.NO_VERSION))
    return findings


def _crc_findings(
    path: Path, records: list[Record], progress: Callable[[int, int], None] | None
) -> list[ArchiveFinding]:
    findings = []
    total, done = sum(r.compress_size for r in records), 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        data = memoryview(view)
        try:
            for r in records:
                if r.compress_type != zipfile.ZIP_STORED:
                    problem = _compressed_problem(path, r)
                    if problem:
                        findings.append(ArchiveFinding(r.name, problem, FindingKind.UNDECOMPRESSABLE))
                    done += r.compress_size
                    continue
                crc = 0
                for start in range(r.data_offset, r.data_offset + r.compress_size, _CRC_CHUNK):
                    end = min(start + _CRC_CHUNK, r.data_offset + r.compress_size)
                    crc = zlib.crc32(data[start:end], crc)
                    if progress is not None:
                        progress(done + end - r.data_offset, total)
                done += r.compress_size
                if crc != r.crc:
                    findings.append(
                        ArchiveFinding(
                            r.name,
                            f"CRC32 mismatch (recorded {r.crc:#010x}, data {crc:#010x}): its bytes changed",
                            FindingKind.CRC_MISMATCH,
                        )
                    )
        finally:
            data.release()
    return findings


def _compressed_problem(path: Path, record: Record) -> str | None:
    try:
        with zipfile.ZipFile(path) as zf, zf.open(record.name) as member:
            while member.read(_CRC_CHUNK):
                pass
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError, OSError) as err:
        return f"cannot be decompressed or fails its CRC32 ({type(err).__name__}: {err})"
    return None
