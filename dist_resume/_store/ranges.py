"""Reading an object on a store by byte ranges: :class:`RangeFile`, a seekable read-only file that fetches what is read.

A torch zip is read from its two ends and its record boundaries: the central directory at the end, ``data.pkl`` at the
start, a local header before each record. :meth:`RangeFile.prefetch` fetches such scattered small ranges in one
batch (concurrent requests where the backend is asynchronous, as s3fs is); everything else goes through one window of
at most ``window`` bytes (a sequential reader makes one request per window), and a read longer than the window is
fetched as asked and not kept. Nothing here holds more than the window and the prefetched pieces; the pieces of the
last 16 objects read are kept (by URL and ETag, at most 4 MiB each), so that the structure a resume checks and then
reads is fetched once.

With a ``cache_dir`` (:class:`~dist_resume._core.location.RemotePath`'s) the object is copied once into that folder,
named by its URL and ETag, and read from there: repeated reads of an unchanged object cost one metadata request.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import secrets
import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Final, cast

from .._core.location import Location, RemotePath, RemoteStat

__all__ = ["DEFAULT_WINDOW", "ReadStats", "READ_STATS", "RangeFile", "cached_copy", "open_binary", "prefetch"]

DEFAULT_WINDOW: Final = 16 << 20
_MERGE_GAP: Final = 64 << 10  # prefetch ranges closer than this are fetched as one


@dataclass
class ReadStats:
    """What this process fetched from stores: requests (ranged GETs) and bytes. Tests and benchmarks read it."""

    requests: int = 0
    bytes: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()

    def add(self, requests: int, nbytes: int) -> None:
        with self._lock:
            self.requests += requests
            self.bytes += nbytes

    def reset(self) -> None:
        with self._lock:
            self.requests = self.bytes = 0


READ_STATS: Final = ReadStats()

# the small ranges read from objects (their two ends, local headers, small records), by URL and ETag: the structure of
# a checkpoint is read several times while a resume checks and reads it, and an object written again has another ETag
_PIECES: OrderedDict[tuple[str, str], list[tuple[int, bytes]]] = OrderedDict()
_PIECES_LOCK: Final = threading.Lock()
_PIECES_OBJECTS: Final = 16
_PIECES_BYTES: Final = 4 << 20  # per object: more is not a structure worth keeping
_SMALL_WINDOW: Final = 256 << 10  # a window this small read an object's structure (its first bytes): kept with it


def _remembered(key: tuple[str, str]) -> list[tuple[int, bytes]]:
    with _PIECES_LOCK:
        pieces = _PIECES.get(key)
        if pieces is None:
            return []
        _PIECES.move_to_end(key)
        return list(pieces)


def _remember(key: tuple[str, str], pieces: list[tuple[int, bytes]]) -> None:
    if sum(len(d) for _, d in pieces) > _PIECES_BYTES:
        return
    with _PIECES_LOCK:
        _PIECES[key] = list(pieces)
        _PIECES.move_to_end(key)
        while len(_PIECES) > _PIECES_OBJECTS:
            _PIECES.popitem(last=False)


def _cache_name(path: RemotePath, stat: RemoteStat) -> str:
    digest = hashlib.sha256(f"{path}\0{stat.etag}\0{stat.st_size}".encode()).hexdigest()[:24]
    return f"{digest}-{re.sub(r'[^A-Za-z0-9._-]', '_', path.name)[:80]}"


def cached_copy(path: RemotePath, stat: RemoteStat, window: int = DEFAULT_WINDOW) -> Path:
    """The local copy of ``path`` (as ``stat`` describes it) in ``path.cache_dir``, fetched first when absent. Local.

    Written to a temporary name and renamed, so a reader never sees a partial copy; a copy of another ETag is
    another name (an object written again is fetched again)."""
    assert path.cache_dir is not None
    folder = Path(path.cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / _cache_name(path, stat)
    if dest.is_file() and dest.stat().st_size == stat.st_size:
        return dest
    tmp = folder / f".{dest.name}.{secrets.token_hex(8)}.tmp"
    try:
        with RangeFile(path, window=window, stat=stat, cache=False) as src, open(tmp, "wb") as out:
            for piece in src.chunks(0, stat.st_size):
                out.write(piece)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


class RangeFile(io.RawIOBase):
    """``path`` as a seekable binary file read by ranges (or from its cached copy). Local; not thread-safe.

    ``requests`` counts this file's fetches. A short answer from the store (the object was truncated or replaced
    while being read) raises ``OSError``.
    """

    def __init__(
        self,
        path: RemotePath,
        *,
        window: int = DEFAULT_WINDOW,
        stat: RemoteStat | None = None,
        cache: bool = True,
    ) -> None:
        super().__init__()
        self.path = path
        self.stat = path.stat() if stat is None else stat
        self.size = self.stat.st_size
        self.window = max(1, window)
        self.requests = 0
        self._pos = 0
        self._key = (str(path), self.stat.etag)
        self._pieces: list[tuple[int, bytes]] = _remembered(self._key)  # prefetched (start, data), sorted by start
        self._win_start, self._win = 0, b""
        self._local: io.BufferedReader | None = None
        if cache and path.cache_dir is not None:
            self._local = open(cached_copy(path, self.stat), "rb")
        self._fs = None if self._local is not None else path.fs

    # --- io.RawIOBase ---------------------------------------------------------------------------------------------

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET, /) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self.size}[whence]
        if base + pos < 0:
            raise OSError(f"negative seek position {base + pos} in {self.path}")
        self._pos = base + pos
        return self._pos

    def read(self, size: int | None = -1, /) -> bytes:
        """Up to ``size`` bytes (all that is left for -1), never allocating more than the object holds."""
        n = self.size - self._pos if size is None or size < 0 else size
        data = bytes(self.read_at(self._pos, n))
        self._pos += len(data)
        return data

    def readall(self) -> bytes:
        return self.read(-1)

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        out = memoryview(buffer).cast("B")
        data = self.read_at(self._pos, len(out))
        out[: len(data)] = data
        self._pos += len(data)
        return len(data)

    def close(self) -> None:
        if self._local is not None:
            self._local.close()
        self._pieces, self._win = [], b""
        super().close()

    # --- ranges ---------------------------------------------------------------------------------------------------

    def _fetch(self, start: int, end: int) -> bytes:
        if self._local is not None:
            self._local.seek(start)
            data = self._local.read(end - start)
        else:
            assert self._fs is not None
            data = self._fs.cat_file(self.path.key, start=start, end=end)
            self.requests += 1
            READ_STATS.add(1, len(data))
        if len(data) != end - start:
            raise OSError(
                f"{self.path} answered {len(data)} of the {end - start} bytes at offset {start}: it was truncated or "
                "replaced while it was being read"
            )
        return bytes(data)

    def read_at(self, start: int, n: int) -> memoryview:
        """Up to ``n`` bytes at ``start`` (fewer only at the end of the object)."""
        n = max(0, min(n, self.size - start))
        if n == 0:
            return memoryview(b"")
        for begin, data in self._pieces:
            if begin <= start and start + n <= begin + len(data):
                return memoryview(data)[start - begin : start - begin + n]
        win_end = self._win_start + len(self._win)
        if self._win_start <= start and start + n <= win_end:
            return memoryview(self._win)[start - self._win_start : start - self._win_start + n]
        if n >= self.window:  # as asked, not kept: the caller holds it
            return memoryview(self._fetch(start, start + n))
        end = min(self.size, start + self.window)
        if self._win_start <= start < win_end:  # a read running past the window: only what follows it is fetched
            self._win, self._win_start = self._win[start - self._win_start :] + self._fetch(win_end, end), start
        else:
            self._win_start, self._win = start, b""  # the old window goes before the new one is fetched
            self._win = self._fetch(start, end)
        if len(self._win) <= _SMALL_WINDOW and not self._covered(start, end):  # an object's ends: kept (see _PIECES)
            self._pieces = sorted([*self._pieces, (start, self._win)])
            _remember(self._key, self._pieces)
        return memoryview(self._win)[:n]

    def chunks(self, start: int, end: int) -> Iterator[memoryview]:
        """The bytes ``[start, end)`` in pieces of at most one window, in order."""
        pos = start
        while pos < end:
            piece = self.read_at(pos, min(self.window, end - pos))
            if not piece:
                raise OSError(f"{self.path} ends at {self.size} bytes, before offset {end}")
            yield piece
            pos += len(piece)

    def prefetch(self, ranges: Iterable[tuple[int, int]]) -> None:
        """Fetch the byte ranges ``[start, end)`` in one batch (ranges closer than 64 KiB fetched as one); later reads
        inside them ask nothing more."""
        wanted = sorted((max(0, s), min(self.size, e)) for s, e in ranges if min(self.size, e) > max(0, s))
        merged: list[list[int]] = []
        for start, end in wanted:
            if self._covered(start, end):
                continue
            if merged and start <= merged[-1][1] + _MERGE_GAP:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        if not merged:
            return
        if self._local is not None or len(merged) == 1:
            fetched = [self._fetch(s, e) for s, e in merged]
        else:
            assert self._fs is not None
            fetched = self._fs.cat_ranges(
                [self.path.key] * len(merged), [s for s, _ in merged], [e for _, e in merged], on_error="raise"
            )
            self.requests += len(merged)
            READ_STATS.add(len(merged), sum(len(d) for d in fetched))
            for (s, e), data in zip(merged, fetched):
                if len(data) != e - s:
                    raise OSError(f"{self.path} answered {len(data)} of the {e - s} bytes at offset {s}")
        self._pieces = sorted([*self._pieces, *((s, bytes(d)) for (s, _), d in zip(merged, fetched))])
        _remember(self._key, self._pieces)

    def _covered(self, start: int, end: int) -> bool:
        return any(b <= start and end <= b + len(d) for b, d in self._pieces)


def open_binary(path: Location, *, window: int = DEFAULT_WINDOW) -> BinaryIO:
    """``path`` opened for reading: a local file, or a :class:`RangeFile` (``window``: how much one request reads
    ahead). Local; the caller closes it."""
    if isinstance(path, RemotePath):
        return cast(BinaryIO, RangeFile(path, window=window))
    return open(path, "rb")


def prefetch(f: Any, ranges: Iterable[tuple[int, int]]) -> None:
    """Fetch ``ranges`` of ``f`` in one batch when it is a :class:`RangeFile`; nothing for a local file."""
    if isinstance(f, RangeFile):
        f.prefetch(ranges)
