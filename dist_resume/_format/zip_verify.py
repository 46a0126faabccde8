"""The integrity of a torch zip checkpoint: its structure and the CRC-32 of every record, which ``torch.load``
never does.

:func:`verify_zip` reads the records (:func:`~dist_resume._format.records.read_records`), then every stored record's
bytes once, in file order: a local file mapped, an object on a store by ranges of 16 MiB. Each problem is an
:class:`ArchiveFinding`; :func:`integrity_failure` is the one refusal built from them.
"""

from __future__ import annotations

import contextlib
import mmap
import zipfile
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

from .._core.errors import CheckpointCorruptError
from .._core.location import Location, RemotePath, looked_up
from .._core.text import preview
from .._store.ranges import RangeFile, open_binary
from .records import Record, read_records
from .safe_open import reading

__all__ = ["FindingKind", "ArchiveFinding", "verify_zip", "integrity_failure", "structure_findings"]

_CRC_CHUNK: Final = 16 << 20


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


def verify_zip(
    path: Location, *, strict: bool = True, progress: Callable[[int, int], None] | None = None
) -> list[ArchiveFinding]:
    """Check one torch zip file's structure and the CRC-32 of every record (the public face is ``verify_archive``).

    An object on a store is read once, by ranges of 16 MiB in file order, never copied whole."""
    p = looked_up(path)
    with reading(p):  # removed meanwhile (a writer's rotation): CheckpointNotFoundError, not damage
        try:
            archive_name, records = read_records(p)
        except CheckpointCorruptError as err:
            findings = [ArchiveFinding(None, str(err), FindingKind.UNREADABLE)]
        else:
            findings = structure_findings(archive_name, records) + _crc_findings(p, records, progress)
        if findings and strict:
            raise integrity_failure(
                repr(str(p)),
                findings,
                "the file was damaged after it was written (disk, copy or "
                "transfer): resume from an earlier checkpoint or copy it again",
            )
    return findings


def integrity_failure(name: str, findings: list[ArchiveFinding], advice: str) -> CheckpointCorruptError:
    """The one refusal for a checkpoint whose integrity check found ``findings``: the first three, then ``advice``."""
    shown = preview(findings, 3, sep="; ", quote=False)
    return CheckpointCorruptError(f"checkpoint {name} failed its integrity check: {shown}; {advice}")


def structure_findings(archive_name: str, records: list[Record]) -> list[ArchiveFinding]:
    """What the records' list alone shows wrong: a name twice, no ``version`` record. Local; reads nothing."""
    findings = []
    seen: set[str] = set()
    for r in records:
        if r.name in seen:
            findings.append(ArchiveFinding(r.name, "appears twice in the archive", FindingKind.DUPLICATE_RECORD))
        seen.add(r.name)
    if f"{archive_name}/version" not in seen:
        findings.append(ArchiveFinding(None, "the archive has no 'version' record", FindingKind.NO_VERSION))
    return findings


def _chunks_of(source: Any, start: int, end: int) -> Iterator[Any]:
    """The bytes ``[start, end)`` of a mapped file (``memoryview``) or a :class:`RangeFile`, 16 MiB at a time."""
    if isinstance(source, RangeFile):
        yield from source.chunks(start, end)
        return
    for begin in range(start, end, _CRC_CHUNK):
        yield source[begin : min(begin + _CRC_CHUNK, end)]


@contextlib.contextmanager
def _bytes_of(path: Location) -> Iterator[Any]:
    """A local file mapped (a ``memoryview``), or an object read by ranges (a :class:`RangeFile`)."""
    if isinstance(path, RemotePath):
        with RangeFile(path, window=_CRC_CHUNK) as ranges:
            yield ranges
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
        data = memoryview(view)
        try:
            yield data
        finally:
            data.release()


def _crc_of(data: Any, r: Record, progress: Callable[[int, int], None] | None, done: int, total: int) -> int:
    """The CRC-32 of one stored record's bytes (no slice of a mapped file outlives this call)."""
    crc, read = 0, 0
    for piece in _chunks_of(data, r.data_offset, r.data_offset + r.compress_size):
        crc = zlib.crc32(piece, crc)
        read += len(piece)
        if progress is not None:
            progress(done + read, total)
    return crc


def _crc_findings(
    path: Location, records: list[Record], progress: Callable[[int, int], None] | None
) -> list[ArchiveFinding]:
    findings = []
    total, done = sum(r.compress_size for r in records), 0
    with _bytes_of(path) as data:
        for r in sorted(records, key=lambda r: r.data_offset):  # in file order: an object is read front to back
            if r.compress_type != zipfile.ZIP_STORED:
                problem = _compressed_problem(path, r)
                if problem:
                    findings.append(ArchiveFinding(r.name, problem, FindingKind.UNDECOMPRESSABLE))
                done += r.compress_size
                continue
            crc = _crc_of(data, r, progress, done, total)
            done += r.compress_size
            if crc != r.crc:
                findings.append(
                    ArchiveFinding(
                        r.name,
                        f"CRC32 mismatch (recorded {r.crc:#010x}, data {crc:#010x}): its bytes changed",
                        FindingKind.CRC_MISMATCH,
                    )
                )
    return findings


def _compressed_problem(path: Location, record: Record) -> str | None:
    try:
        with contextlib.ExitStack() as stack:
            source = stack.enter_context(open_binary(path)) if isinstance(path, RemotePath) else path
            zf = stack.enter_context(zipfile.ZipFile(source))
            member = stack.enter_context(zf.open(record.name))
            while member.read(_CRC_CHUNK):
                pass
    except FileNotFoundError:
        raise  # the file removed meanwhile (verify_zip says so), not a record that cannot be read
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, ValueError, OSError) as err:
        return f"cannot be decompressed or fails its CRC32 ({type(err).__name__}: {err})"
    return None
