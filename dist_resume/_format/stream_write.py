"""Writing one ordinary torch zip checkpoint tensor by tensor: the structure first, then each storage as it comes.

``torch.save`` needs every tensor in memory at once. :func:`write_streamed` pickles the structure with
meta stand-ins (shape and dtype are all ``data.pkl`` needs), writes it, then asks for each tensor's
bytes in turn and writes them as they arrive, computing each record's CRC-32 on the way: the caller
may produce a tensor piece by piece (rank 0 receiving FSDP2 shards into one reused buffer) and drop
each piece once written. The records are the ones torch 2.13 writes, in its order (``data.pkl``,
``.format_version``, ``.storage_alignment``, ``byteorder``, ``data/0`` ..., ``version``,
``.data/serialization_id``), so ``torch.load(weights_only=True, mmap=True)`` and this package's
readers take it as torch's own.
"""

from __future__ import annotations

import ctypes
import secrets
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Final

import torch

from .._core import torch_compat
from .._core.errors import CheckpointWriteError
from .._core.tree import map_tensors
from .archive import ArchiveContents, StorageInfo
from .pickle_write import dump_pickle
from .zip_write import ZipWriter, write_all

__all__ = ["distinct_tensors", "write_streamed"]

ARCHIVE_NAME: Final = "archive"
_WRITE_CHUNK: Final = 64 << 20

Pieces = Callable[[int, torch.Tensor], Iterable[torch.Tensor]]


def distinct_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors of ``obj`` in the order :func:`write_streamed` writes (and asks for) them: walk order,
    each tensor object once (a tensor reachable twice, e.g. tied weights, is one record). Local."""
    seen: dict[int, torch.Tensor] = {}
    map_tensors(obj, lambda t: seen.setdefault(id(t), t))
    return list(seen.values())


def _whole(_: int, tensor: torch.Tensor) -> Iterable[torch.Tensor]:
    return (tensor.detach().cpu().contiguous(),)


def _byte_view(piece: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (no numpy needed)."""
    nbytes = piece.numel() * piece.element_size()
    if not nbytes:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(piece.data_ptr())).cast("B")


def write_streamed(fd: int, obj: Any, pieces: Pieces | None = None) -> int:
    """Write ``obj`` to ``fd`` as a torch zip checkpoint, one tensor at a time; return the file's size. Local.

    ``obj`` holds tensors (any kind whose ``shape`` and ``dtype`` are the full value's, a DTensor too)
    among what ``torch.save`` pickles. For the i-th tensor of :func:`distinct_tensors`, ``pieces(i,
    tensor)`` yields contiguous CPU tensors whose bytes, in order, are its row-major data (by default the
    tensor itself); each piece is written before the next is asked for. Every tensor is saved as one
    contiguous CPU tensor of its own storage (views are not kept as views; ``requires_grad`` is not
    kept). Raises :class:`CheckpointWriteError` when the pieces do not add up to the tensor's size.

    Example::

        >>> import os
        >>> fd = os.open("w.pt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        >>> size = write_streamed(fd, {"w": torch.ones(2, 3), "step": 7}); os.close(fd)
        >>> torch.load("w.pt", weights_only=True)
        {'w': tensor([[1., 1., 1.],
                [1., 1., 1.]]), 'step': 7}
    """
    pieces = pieces or _whole
    tensors = distinct_tensors(obj)
    contents = ArchiveContents(Path(), ARCHIVE_NAME, [], 0, None, {})
    stand_ins: dict[int, torch.Tensor] = {}
    for i, tensor in enumerate(tensors):
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        cls, storage_dtype = torch_compat.storage_class_for(tensor.dtype)
        nbytes = meta.numel() * tensor.dtype.itemsize
        numel = nbytes // storage_dtype.itemsize
        key = str(i)
        contents.register(
            meta.untyped_storage(),
            StorageInfo(key, storage_dtype, "cpu", numel, nbytes, ("storage", cls, key, "cpu", numel)),
        )
        stand_ins[id(tensor)] = meta
    writer = ZipWriter(fd)
    writer.add_bytes(f"{ARCHIVE_NAME}/data.pkl", dump_pickle(map_tensors(obj, lambda t: stand_ins[id(t)]), contents))
    writer.add_bytes(f"{ARCHIVE_NAME}/.format_version", b"1")
    writer.add_bytes(f"{ARCHIVE_NAME}/.storage_alignment", b"64")
    writer.add_bytes(f"{ARCHIVE_NAME}/byteorder", b"little")
    for i, tensor in enumerate(tensors):
        nbytes = contents.storages[str(i)].nbytes

        def fill(offset: int, i: int = i, tensor: torch.Tensor = tensor, nbytes: int = nbytes) -> int:
            crc, written = 0, 0
            for piece in pieces(i, tensor):
                if piece.device.type != "cpu" or not piece.is_contiguous():
                    raise CheckpointWriteError(
                        f"tensor {i} of the checkpoint came as a non-contiguous or non-CPU piece"
                    )
                view = _byte_view(piece)
                if written + len(view) > nbytes:
                    written += len(view)
                    break
                for start in range(0, len(view), _WRITE_CHUNK):
                    chunk = view[start : start + _WRITE_CHUNK]
                    write_all(fd, chunk, offset + written + start)
                    crc = zlib.crc32(chunk, crc)
                written += len(view)
            if written != nbytes:
                raise CheckpointWriteError(
                    f"tensor {i} of the checkpoint ({tuple(tensor.shape)}, {tensor.dtype}) should hold {nbytes} bytes "
                    f"but its data came to {written if written <= nbytes else 'more'}; nothing was saved"
                )
            return crc

        writer.add_streamed(f"{ARCHIVE_NAME}/data/{i}", size=nbytes, fill=fill)
    writer.add_bytes(f"{ARCHIVE_NAME}/version", b"3\n")
    writer.add_bytes(f"{ARCHIVE_NAME}/.data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
    return writer.finish()
