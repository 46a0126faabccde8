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
import zlib
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch

from .._core.errors import CheckpointWriteError
from .tensor_records import ARCHIVE_NAME, distinct_tensors, plan_records
from .zip_write import ZipWriter, write_all

__all__ = ["ARCHIVE_NAME", "distinct_tensors", "write_streamed"]

_WRITE_CHUNK: Final = 64 << 20

Pieces = Callable[[int, torch.Tensor], Iterable[torch.Tensor]]


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
    plan = plan_records(obj)
    writer = ZipWriter(fd)
    for name, data in plan.head:
        writer.add_bytes(name, data)
    for i, (tensor, nbytes) in enumerate(zip(plan.tensors, plan.sizes)):

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

        writer.add_streamed(plan.name(i), size=nbytes, fill=fill)
    for name, data in plan.foot:
        writer.add_bytes(name, data)
    return writer.finish()
