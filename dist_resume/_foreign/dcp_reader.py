"""torch's DCP reader, reading a folder's files as regular files inside it and every stored tensor checked against
``.metadata`` before its data is copied anywhere.

torch's ``FileSystemReader`` opens whatever path ``.metadata`` names, hands each entry's bytes to ``torch.load``, and
copies the loaded tensor into its destination with ``Tensor.copy_``, which casts: an entry whose stored dtype or
shape differs from what ``.metadata`` declares for that chunk is restored as a silently cast or cut value. Here
:class:`DcpReader` reads ``.metadata`` through the allowlist (:func:`~.dcp_metadata.read_dcp_metadata`), the objects
as torch does (each entry's zip directory checked first), and each tensor chunk itself: the entry's zip directory
checked, ``torch.load(weights_only=True)`` straight from the file (nothing else is held: one saved chunk at a time),
its dtype and shape compared with the chunk ``.metadata`` declares (a difference is
:class:`~dist_resume.errors.CheckpointCorruptError` naming the file and the key), then its box copied into the
destination.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._core.errors import CheckpointCorruptError, CheckpointError
from .._core.location import Location
from .._core.torch_compat.private import zstd_available
from .._format.dcp.entries import Window
from .._format.records import check_zip_bytes, check_zip_stream
from .._format.safe_open import open_in_folder
from .dcp_metadata import read_dcp_metadata

__all__ = ["DcpReader"]


class _FolderFiles(FileSystem):
    """torch's FileSystem that opens a DCP folder's files as :func:`open_in_folder` does: a regular file inside the
    folder, never a link, FIFO or device node (``.metadata`` may name any file); objects on a store by ranges.
    ``root`` is the path torch's reader joins the file names to (for a folder on a store, a stand-in naming it)."""

    def __init__(self, folder: Location, root: Path) -> None:
        super().__init__()
        self._folder, self._root = folder, root

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        where = Path(path)
        if mode != "rb" or where.parent != self._root:
            raise CheckpointCorruptError(f"DCP folder {str(self._folder)!r}: {str(where)!r} is not a file inside it")
        with open_in_folder(self._folder, where.name) as stream:
            yield cast(io.IOBase, stream)


class DcpReader(FileSystemReader):
    """torch's FileSystemReader, reading ``.metadata`` through the allowlist, the data files as regular files inside
    the folder, and each tensor chunk checked against ``.metadata`` (see the module). Collective only as
    ``dcp.load`` is."""

    def __init__(self, path: Location, weights_only: bool) -> None:
        # torch's reader joins its path and each file's name; on a store only the name travels (_FolderFiles opens it)
        super().__init__(path if isinstance(path, Path) else Path(path.name))
        self._folder, self._weights_only = path, weights_only
        self._declared: dict[str, Any] = {}
        self.fs = _FolderFiles(path, Path(self.path))

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        """One object entry's bytes, checked like a torch file before torch.load sees them: torch's zip reader trusts
        the sizes in each entry's directory and would allocate whatever a damaged field claims."""
        file.seek(sinfo.offset)
        data = file.read(sinfo.length)
        if len(data) != sinfo.length:
            raise CheckpointCorruptError(
                f"DCP folder {str(self._folder)!r}: an entry of {sinfo.relative_path!r} runs past the end of the file "
                f"({sinfo.offset} + {sinfo.length} bytes); the folder is truncated or damaged"
            )
        if data[:4] == b"PK\x03\x04":
            check_zip_bytes(data, f"DCP folder {str(self._folder)!r}: an entry of {sinfo.relative_path!r}")
        return io.BytesIO(data)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self._folder, weights_only=self._weights_only)
        self._declared = dict(metadata.state_dict_metadata)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._declared = dict(metadata.state_dict_metadata)  # on a rank that did not read it itself
        if not zstd_available() and any(s.transform_descriptors for s in self.storage_data.values()):
            raise CheckpointError(  # no damage: this environment cannot undo the compression the save chose
                f"DCP folder {str(self._folder)!r} holds zstd-compressed entries, and neither zstandard nor pyzstd is "
                "installed here: pip install zstandard"
            )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        objects = [r for r in plan.items if r.type is LoadItemType.BYTE_IO]
        if objects:  # torch's own way (through _slice_file): small, and each checked as a torch file
            super().read_data(dataclasses.replace(plan, items=objects), planner).wait()
        by_file: dict[str, list[ReadItem]] = {}
        for req in plan.items:
            if req.type is not LoadItemType.BYTE_IO:
                by_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for name, reqs in by_file.items():
            with open_in_folder(self._folder, name) as stream:
                size = stream.seek(0, io.SEEK_END)
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    self._read_tensor(stream, size, name, req, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_tensor(self, stream: Any, size: int, name: str, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        index = req.storage_index
        what = f"{str(self._folder / name)!r}: the entry of {index.fqn!r} at {tuple(index.offset or ())}"
        if info.offset + info.length > size:
            raise CheckpointCorruptError(f"{what} runs past the end of the file; the folder is truncated")
        raw: Any = Window(stream, info.offset, info.length)
        if info.transform_descriptors:  # compressed: undone by torch's transforms, then checked whole in memory
            raw = io.BytesIO(self.transforms.transform_load_stream(req, info.transform_descriptors, raw).read(-1))
            check_zip_bytes(raw.getvalue(), what)
        else:
            check_zip_stream(raw, info.length, what)
        raw.seek(0)
        chunk = torch.load(cast(IO[bytes], raw), map_location="cpu", weights_only=True)
        self._check_chunk(chunk, req, what)
        box = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))
        piece = chunk[box] if box else chunk
        target = planner.resolve_tensor(req).detach()
        if target.shape != piece.shape:
            raise CheckpointCorruptError(
                f"{what} gives a box of shape {tuple(piece.shape)} for a destination of {tuple(target.shape)}; the "
                "folder is damaged: resume from an earlier checkpoint"
            )
        target.copy_(piece)
        del chunk, piece
        planner.commit_tensor(req, target)

    def _check_chunk(self, chunk: Any, req: ReadItem, what: str) -> None:
        """``chunk`` (as loaded) is a tensor of the dtype and chunk shape ``.metadata`` declares for it."""
        declared = self._declared.get(req.storage_index.fqn)
        offsets = tuple(req.storage_index.offset or ())
        sizes = next((tuple(c.sizes) for c in getattr(declared, "chunks", ()) if tuple(c.offsets) == offsets), None)
        dtype = getattr(getattr(declared, "properties", None), "dtype", None)
        if isinstance(chunk, torch.Tensor) and chunk.dtype == dtype and tuple(chunk.shape) == sizes:
            return
        found = (
            f"a {chunk.dtype} tensor of shape {tuple(chunk.shape)}"
            if isinstance(chunk, torch.Tensor)
            else f"a {type(chunk).__name__}"
        )
        raise CheckpointCorruptError(
            f"{what} holds {found}, but .metadata declares {dtype} of shape {sizes} for that chunk; the folder is "
            "damaged (or its .metadata belongs to another save): resume from an earlier checkpoint"
        )
