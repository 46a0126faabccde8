"""Reading ``.safetensors`` files with torch alone: an 8-byte header length, a JSON header, raw bytes.

The format (https://github.com/huggingface/safetensors) is simple enough to read without the
``safetensors`` package, so the runtime dependency stays torch only; the package serves as a
cross-check in the tests. Every length and offset in the header is checked against the file size
before a byte is interpreted, and nothing in the file is executed or unpickled.
"""

from __future__ import annotations

import itertools
import json
import mmap as _mmap
import sys
from pathlib import Path
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError
from .._core.location import Location, local_path
from .._core.text import preview
from .._core.types import MapLocation
from .._core.untrusted import untrusted
from .._format.load import rank_map_location
from .._format.safe_open import open_checkpoint_file, vanished

__all__ = ["SAFETENSORS_SUFFIX", "is_safetensors", "read_safetensors_header", "read_safetensors"]

SAFETENSORS_SUFFIX: Final = ".safetensors"
_MAX_HEADER: Final = 100_000_000  # the limit the reference implementation enforces
_MAX_DIM: Final = (1 << 63) - 1  # a dimension torch.Size holds (JSON's integers are unbounded)
_MAX_DIMS: Final = 64
_DTYPE_NAMES: Final = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
}
DTYPES: Final[dict[str, torch.dtype]] = {
    code: getattr(torch, name) for code, name in _DTYPE_NAMES.items() if hasattr(torch, name)
}


def is_safetensors(path: Location) -> bool:
    """True when the file's first bytes look like a safetensors header (a length, then ``{``). Local."""
    try:
        p = _local(path)
        with open_checkpoint_file(p) as f:
            head = f.read(9)
            size = p.stat().st_size
    except OSError:
        return False
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = int.from_bytes(head[:8], "little")
    return 0 < n <= min(_MAX_HEADER, size - 8)


def _local(path: Location) -> Path:
    """``path`` as a local path: a safetensors file is read from local disk only (one on a store is refused earlier,
    by :func:`~dist_resume._foreign.folders.foreign_kind`)."""
    return local_path(path, "reading a safetensors file")


def _bad(path: Path, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{str(path)!r} is not a valid safetensors file: {what}; "
        "the file is damaged or truncated (re-download or re-save it)"
    )


def read_safetensors_header(path: Location) -> tuple[int, dict[str, Any], dict[str, str]]:
    """``(data_start, entries, metadata)``: each entry is ``{"dtype", "shape", "data_offsets"}``, validated. Local.

    Raises :class:`CheckpointCorruptError` when a length, offset, dtype or shape does not fit the file.
    """
    p = _local(path)
    try:
        size = p.stat().st_size
        with open_checkpoint_file(p) as f:
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise _bad(p, f"the file has {size} bytes, fewer than the 8-byte header length")
            n = int.from_bytes(raw_len, "little")
            if n > _MAX_HEADER or 8 + n > size:
                raise _bad(p, f"the header claims {n} bytes but the file has {size}")
            raw = f.read(n)
    except FileNotFoundError as err:  # there when the source was resolved: removed meanwhile
        raise vanished(p, err) from err
    except OSError as err:
        raise CheckpointError(f"cannot read {str(p)!r}: {err.strerror or err}") from err
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: an int of 4,300+ digits too
        raise _bad(p, f"the header is not JSON ({type(err).__name__}: {str(err)[:200]})") from err
    with untrusted(f"safetensors file {str(p)!r}", "its header"):
        return _checked_header(p, header, n, size)


def _checked_header(p: Path, header: Any, n: int, size: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    if not isinstance(header, dict):
        raise _bad(p, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise _bad(p, "'__metadata__' is not an object")
    data_start, data_len = 8 + n, size - 8 - n
    spans = []
    for key, entry in header.items():
        spans.append((*_check_entry(p, key, entry, data_len), key))
    spans.sort()
    for (_, prev_end, prev_key), (begin, _, key) in itertools.pairwise(spans):
        if begin < prev_end:
            raise _bad(p, f"tensors {prev_key!r} and {key!r} overlap")
    return data_start, header, {str(k): str(v) for k, v in metadata.items()}


def _check_entry(p: Path, key: str, entry: Any, data_len: int) -> tuple[int, int]:
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise _bad(p, f"entry {key!r} lacks dtype, shape or data_offsets")
    if not isinstance(entry["dtype"], str):
        raise _bad(p, f"entry {key!r} has dtype {entry['dtype']!r}")
    dtype = DTYPES.get(entry["dtype"])
    if dtype is None:
        raise NotACheckpointError(
            f"{str(p)!r}: tensor {key!r} has dtype {entry['dtype']!r}, which this torch cannot hold "
            f"(known: {preview(sorted(DTYPES), 20)})"
        )
    shape, offsets = entry["shape"], entry["data_offsets"]
    if not (
        isinstance(shape, list)
        and len(shape) <= _MAX_DIMS
        and all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape)
    ):
        raise _bad(p, f"entry {key!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _bad(p, f"entry {key!r} has data_offsets {offsets!r}")
    begin, end = offsets
    numel = 1
    for d in shape:
        numel *= d
    expected = numel * dtype.itemsize
    if not 0 <= begin <= end <= data_len or end - begin != expected:
        raise _bad(
            p,
            f"entry {key!r} ({entry['dtype']} {shape}) spans bytes {begin}..{end} of {data_len}, it needs {expected}",
        )
    return begin, end


def read_safetensors(
    path: Location, *, map_location: MapLocation = "cpu", mmap: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(state_dict, metadata)`` of a ``.safetensors`` file, read with torch alone. Local.

    ``mmap=True`` maps the file copy-on-write (tensors page in when touched); ``mmap=False`` reads
    it into memory. ``map_location`` is a device (``None`` means :func:`rank_map_location`); a dict
    or callable is refused, since safetensors carries no device tags to map. Keys keep the file's
    order of offsets.

    Example::

        >>> sd, meta = read_safetensors(Path("model.safetensors"))
    """
    if sys.byteorder != "little":
        raise CheckpointError(f"cannot read {str(path)!r}: safetensors is little-endian and this machine is not")
    if isinstance(map_location, dict) or callable(map_location):
        raise CheckpointError(
            f"map_location={map_location!r} cannot be applied to {str(path)!r}: a safetensors file has no "
            "device tags; pass a device ('cpu', 'cuda:1') or None for this rank's device"
        )
    device = rank_map_location(map_location) if map_location is None or isinstance(map_location, int) else None
    device = device or torch.device(map_location)  # type: ignore[arg-type]
    data_start, entries, metadata = read_safetensors_header(path)
    p = _local(path)
    with open_checkpoint_file(p) as f:
        if mmap and p.stat().st_size > 0:
            buffer: Any = _mmap.mmap(f.fileno(), 0, access=_mmap.ACCESS_COPY)
        else:
            buffer = bytearray(f.read())
    whole = torch.frombuffer(buffer, dtype=torch.uint8) if len(buffer) else torch.empty(0, dtype=torch.uint8)
    out: dict[str, torch.Tensor] = {}
    for key, entry in sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        raw = whole[data_start + begin : data_start + end]
        if (data_start + begin) % dtype.itemsize:  # views need aligned storage offsets
            raw = raw.clone()
        tensor = raw.view(dtype).reshape(entry["shape"]) if raw.numel() else torch.empty(entry["shape"], dtype=dtype)
        out[key] = tensor if device.type == "cpu" else tensor.to(device)
    return out, metadata
