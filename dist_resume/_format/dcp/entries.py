"""A DCP folder's stored entries checked against ``.metadata`` by their headers, before their data is read.

Each tensor chunk a DCP ``.distcp`` file holds is one ``torch.save`` archive whose ``data.pkl`` says the chunk's dtype
and shape. ``.metadata`` declares both too, and a reader allocates and fills from the declaration: an entry whose
header says otherwise (``.metadata`` damaged, or a shard of another save) is restored as a cast or cut value.
:func:`entries_problem` reads each entry's zip directory and ``data.pkl`` (a few hundred bytes; no tensor data) and
compares them (an object entry, which the readers load with ``torch.load`` too: its directory and its ``data.pkl``'s
CRC-32, which ``torch.load`` never checks):
the deep check (``verify``) runs it beside every CRC-32, so a folder whose entries contradict its
``.metadata`` is never chosen, and a resume refuses it before anything changes. An entry the torch-free reader cannot
describe (a compressed one, a dtype without a typed storage) is left to the reader's own check
(:mod:`~dist_resume._foreign.dcp_reader`), which compares the loaded tensor.

Torch-free: this module imports nothing but the standard library, the error classes and the modules beside it.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Final

from ..._core.errors import CheckpointCorruptError
from ..._core.location import Location
from ..peek import PeekUnsure, TensorStub, peek_pickle
from ..records import check_zip_stream
from ..safe_open import open_in_folder

if TYPE_CHECKING:
    from .view import DcpView

__all__ = ["Window", "entries_problem"]

_MAX_PICKLE: Final = 1 << 20  # one tensor's data.pkl is about 200 bytes


class Window(io.RawIOBase):
    """``length`` bytes of ``base`` from ``offset``, as a seekable stream (one entry of a ``.distcp`` file): torch.load
    reads each record straight into the tensor it builds, so nothing but that tensor is allocated."""

    def __init__(self, base: Any, offset: int, length: int) -> None:
        super().__init__()
        self._base, self._offset, self._length = base, offset, length
        self.seek(0)

    def seek(self, pos: int, whence: int = io.SEEK_SET, /) -> int:
        start = {io.SEEK_SET: self._offset, io.SEEK_CUR: self._base.tell(), io.SEEK_END: self._offset + self._length}
        return int(self._base.seek(start[whence] + pos, io.SEEK_SET)) - self._offset

    def tell(self) -> int:
        return int(self._base.tell()) - self._offset

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = max(0, self._length - self.tell())
        view = memoryview(buffer).cast("B")[:left]
        return int(self._base.readinto(view)) if left else 0


def _header(window: Window, length: int, what: str) -> Any:
    """What ``data.pkl`` holds in one entry (its zip directory checked, its CRC-32 too), tensors as
    :class:`TensorStub`; None where the torch-free reader cannot say. Raises :class:`CheckpointCorruptError` for a
    damaged entry."""
    records = check_zip_stream(window, length, what)
    archive = records[0].name.partition("/")[0] if records else ""
    pickled = next((r for r in records if r.name == f"{archive}/data.pkl"), None)
    if pickled is None or pickled.compress_size != pickled.file_size or pickled.file_size > _MAX_PICKLE:
        return None  # no data.pkl, a deflated one, one too large: torch's reader says what is wrong
    window.seek(pickled.data_offset)
    data = window.read(pickled.compress_size)
    if len(data or b"") != pickled.compress_size or zlib.crc32(data) != pickled.crc:
        raise CheckpointCorruptError(f"{what} is damaged: its data.pkl is short or fails its CRC-32 check")
    try:
        return peek_pickle(data)
    except PeekUnsure:
        return None


def entries_problem(folder: Location, view: DcpView, files: Collection[str]) -> str | None:
    """What in the entries stored in ``files`` (names of ``folder``'s data files) contradicts ``view`` (the folder's
    ``.metadata``, checked): an entry that is no sound torch archive (its zip directory, its ``data.pkl``'s CRC-32),
    a tensor chunk whose stored dtype or shape is not what ``.metadata`` declares. None when they agree. Local; reads
    each entry's directory and ``data.pkl``, no tensor data."""
    by_file: dict[str, list[tuple[int, int, str, tuple[int, ...] | None]]] = {}
    for (fqn, offsets), stored in view.stored.items():
        if stored.file in files and not stored.transformed:
            by_file.setdefault(stored.file, []).append((stored.offset, stored.length, fqn, offsets))
    for name in sorted(by_file):
        with open_in_folder(folder, name) as stream:
            for offset, length, fqn, offsets in sorted(by_file[name], key=lambda e: e[:2]):
                what = f"the entry of {fqn!r}{'' if offsets is None else f' at {offsets}'} in {name!r}"
                try:
                    stub = _header(Window(stream, offset, length), length, what)
                except CheckpointCorruptError as err:
                    return str(err)
                if offsets is None or not isinstance(stub, TensorStub):
                    continue
                entry = view.tensors[fqn]
                sizes = next(c.sizes for c in entry.chunks if c.offsets == offsets)
                if (stub.storage.dtype, stub.shape) != (entry.dtype, sizes):
                    return (
                        f"{what} holds {stub.storage.dtype} of shape {stub.shape}, but .metadata declares "
                        f"{entry.dtype} of shape {sizes} for that chunk"
                    )
    return None
