"""A torch zip read by byte ranges (on an object store, or a local file for a striped resume): its structure first
(meta stand-ins), each tensor's data later, straight into the tensor that keeps it.

:func:`open_ranged` reads what :func:`~dist_resume._format.archive.read_archive` reads (the directory, every local
header and the small records, each CRC-32 checked; no tensor byte). A resume plans on the stand-ins, reads the few
tensors its steps need into fresh memory (:meth:`RangedArchive.read_fresh`) and, at its commit, the rest straight into
the live tensors (:meth:`RangedArchive.transfer`): a contiguous tensor of the saved dtype on the CPU receives the bytes
in place; any other destination (another dtype, an accelerator) receives them one window at a time. What is held
beyond the destinations is one window (``bucket_bytes``), except for a saved tensor that is not contiguous, which is
read whole into fresh memory first (``torch.save`` of a state dict writes none). Records are read in file order, so
neighbouring small tensors share one request. A local file is read by positional reads
(:class:`~dist_resume._format.local_ranges.LocalRanges`): a contiguous CPU destination of the saved dtype receives one
read syscall into its own bytes.
"""

from __future__ import annotations

import warnings
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.location import Location, RemotePath
from .._store.ranges import RangeFile
from .archive import ArchiveContents, read_archive
from .local_ranges import LocalRanges, check_record_crc
from .records import Record

__all__ = ["DEFAULT_RANGE_BYTES", "RangedArchive", "open_ranged"]

DEFAULT_RANGE_BYTES = 64 << 20  # one window of ranged reads: the same bound as a broadcast's bucket


@dataclass(frozen=True, slots=True)
class _Span:
    """Where a stand-in's data lies in the object: ``nbytes`` from ``start`` (its storage offset included)."""

    start: int
    nbytes: int


def _bytes(piece: memoryview) -> torch.Tensor:
    with warnings.catch_warnings():  # the bytes are read-only: they are only ever copied from
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(piece, dtype=torch.uint8)


class RangedArchive:
    """A checkpoint whose structure is read (:attr:`obj`, meta stand-ins) and whose tensors' data is read on demand,
    by ranges (an object on a store) or positional reads (a local file), through one window of ``bucket_bytes``.
    Local; close it (or use ``with``) to let the window and the file go."""

    def __init__(self, contents: ArchiveContents, *, bucket_bytes: int = DEFAULT_RANGE_BYTES) -> None:
        self.contents = contents
        self.path: Location = contents.path
        self.bucket_bytes = max(64, bucket_bytes - bucket_bytes % 64)  # whole elements of any dtype per window
        self._records = {r.name: r for r in contents.records}
        self._file: RangeFile | LocalRanges | None = None
        self._whole: tuple[torch.Tensor, torch.Tensor] | None = None  # read_bytes of a stand-in not contiguous

    @property
    def obj(self) -> object:
        return self.contents.obj

    def __enter__(self) -> RangedArchive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._whole = None
        if self._file is not None:
            self._file.close()
            self._file = None

    def _reader(self) -> RangeFile | LocalRanges:
        if self._file is None:
            path = self.path
            if isinstance(path, RemotePath):
                self._file = RangeFile(path, window=self.bucket_bytes)
            else:
                self._file = LocalRanges(path, window=self.bucket_bytes)
        return self._file

    def identity(self) -> tuple[object, ...]:
        """What tells this file's contents from another's without reading them: its archive name and every record's
        name, size and CRC-32 (the central directory's), in file order."""
        return (self.contents.archive_name, *((r.name, r.file_size, r.crc) for r in self.contents.records))

    def tensor_records(self) -> list[Record]:
        """The records holding tensor data, in file order (each one storage)."""
        prefix = f"{self.contents.archive_name}/data/"
        return [r for r in self.contents.records if r.name.startswith(prefix)]

    def check_crc(self, record: Record) -> None:
        """Raise :class:`CheckpointCorruptError` unless ``record`` (of a local file) matches its CRC-32."""
        reader = self._reader()
        if not isinstance(reader, LocalRanges):
            raise TypeError("record checks by positional reads are for local files")
        check_record_crc(reader, record)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is one of this archive's stand-ins (its data still in the object)."""
        return tensor.is_meta and self.contents.storage_of(tensor) is not None

    def _record(self, tensor: torch.Tensor) -> Record:
        info = self.contents.storage_of(tensor)
        if info is None:
            raise ValueError("not a tensor of this archive")
        record = self._records.get(f"{self.contents.archive_name}/data/{info.key}")
        if record is None:
            raise CheckpointCorruptError(
                f"checkpoint {str(self.path)!r} is damaged: data.pkl names storage {info.key!r}, which has no record; "
                "resume from an earlier checkpoint"
            )
        if record.file_size < info.nbytes:
            raise CheckpointCorruptError(
                f"checkpoint {str(self.path)!r} is damaged: storage {info.key!r} holds {record.file_size} bytes, "
                f"not the {info.nbytes} data.pkl says; resume from an earlier checkpoint"
            )
        return record

    def _span(self, tensor: torch.Tensor) -> _Span:
        """The bytes of a contiguous stand-in."""
        record = self._record(tensor)
        size = tensor.element_size()
        start, nbytes = int(tensor.storage_offset()) * size, tensor.numel() * size
        if start + nbytes > record.file_size:
            raise CheckpointCorruptError(
                f"checkpoint {str(self.path)!r} is damaged: a tensor of {nbytes} bytes at byte {start} of its storage "
                f"runs past the storage's {record.file_size} bytes; resume from an earlier checkpoint"
            )
        return _Span(record.data_offset + start, nbytes)

    def _fill(self, out: torch.Tensor, span: _Span) -> None:
        """Write the ``span`` bytes into the flat uint8 CPU tensor ``out`` (contiguous): a local file's in one
        positional read, an object's one window at a time."""
        reader = self._reader()
        if isinstance(reader, LocalRanges):
            reader.fill(span.start, out)
            return
        offset = 0
        for piece in reader.chunks(span.start, span.start + span.nbytes):
            out[offset : offset + len(piece)].copy_(_bytes(piece))
            offset += len(piece)

    def _compressed(self, tensor: torch.Tensor) -> bool:
        return self._record(tensor).compress_type != zipfile.ZIP_STORED

    def read_fresh(self, tensors: Iterable[torch.Tensor]) -> dict[int, torch.Tensor]:
        """``{id(stand-in): a new CPU tensor holding its data}`` for each of ``tensors`` held here, read in file order."""
        held = [t for t in tensors if self.holds(t)]
        return {id(t): self._materialize(t) for t in sorted(held, key=self.offset_of)}

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Where the stand-in ``tensor``'s data starts in the file (its records' order is the file's)."""
        return self._record(tensor).data_offset + int(tensor.storage_offset()) * tensor.element_size()

    def _materialize(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._compressed(tensor):
            raise NotACheckpointError(
                f"checkpoint {str(self.path)!r} holds compressed tensor data, which torch.save never writes and which "
                "cannot be read by ranges; re-save it with torch.save"
            )
        if tensor.is_contiguous():
            out = torch.empty(tensor.shape, dtype=tensor.dtype)
            if out.numel():
                self._fill(out.view(-1).view(torch.uint8), self._span(tensor))
        else:  # the storage's elements this view reaches, then the view itself
            extent = 1 + sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) if tensor.numel() else 0
            base = tensor.as_strided((extent,), (1,), tensor.storage_offset())
            flat = torch.empty(extent, dtype=tensor.dtype)
            if extent:
                self._fill(flat.view(torch.uint8), self._span(base))
            out = flat.as_strided(tensor.shape, tensor.stride())
        if tensor.requires_grad:
            out.requires_grad_(True)
        return out

    def read_bytes(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Bytes ``[start, start + len(out))`` of the stand-in's data, as its contiguous bytes, into the flat uint8
        CPU tensor ``out`` (a broadcast's bucket). A stand-in that is not contiguous is read whole once and kept
        until the next one."""
        if tensor.is_contiguous() and not self._compressed(tensor):
            span = self._span(tensor)
            self._fill(out, _Span(span.start + start, out.numel()))
            return
        if self._whole is None or self._whole[0] is not tensor:
            self._whole = (tensor, self._materialize(tensor).contiguous().view(-1).view(torch.uint8))
        out.copy_(self._whole[1][start : start + out.numel()])

    def read_into(self, saved: torch.Tensor, dst: torch.Tensor) -> None:
        """Write the data of the stand-in ``saved`` into ``dst`` (its shape; any dtype and device), as ``dst.copy_``
        would, holding at most one window beyond ``dst``."""
        if not saved.is_contiguous() or not dst.is_contiguous() or dst.shape != saved.shape or self._compressed(saved):
            dst.copy_(self._materialize(saved))
            return
        span = self._span(saved)
        if dst.device.type == "cpu" and dst.dtype == saved.dtype and dst.numel():
            self._fill(dst.view(-1).view(torch.uint8), span)  # straight into the live tensor's bytes
            return
        flat, size, done = dst.view(-1), saved.element_size(), 0
        for piece in self._reader().chunks(span.start, span.start + span.nbytes):
            n = len(piece) // size
            flat[done : done + n].copy_(_bytes(piece).view(saved.dtype))
            done += n

    def transfer(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Exception | None:
        """The commit's transfer: each ``(saved, live)`` pair written in place, this archive's stand-ins by ranges in
        file order, any other tensor copied; the first failure, or None (never raises)."""
        try:
            with torch.no_grad():
                for saved, dst in sorted(pairs, key=lambda p: self.offset_of(p[0]) if self.holds(p[0]) else -1):
                    if self.holds(saved):
                        self.read_into(saved, dst)
                    else:
                        dst.copy_(saved)
        except Exception as err:  # the caller raises PartialRestoreError (after agreeing, when collective)
            return err
        finally:
            self.close()
        return None


def open_ranged(path: Location, *, bucket_bytes: int | None = None) -> RangedArchive:
    """The checkpoint at ``path`` (an object on a store, or a local file) with its structure read and its tensor data
    left where it is. Local.

    Refuses what ``torch.load(weights_only=True)`` refuses, and checks the zip structure and the CRC-32 of every
    small record, as :func:`~dist_resume._format.archive.read_archive` does. ``bucket_bytes``: the window of the
    data reads (:data:`DEFAULT_RANGE_BYTES` when None)."""
    window = DEFAULT_RANGE_BYTES if bucket_bytes is None else bucket_bytes
    return RangedArchive(read_archive(path), bucket_bytes=window)
