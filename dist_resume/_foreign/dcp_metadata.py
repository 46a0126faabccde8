"""A DCP folder's ``.metadata``: unpickled through an allowlist of DCP's own classes, then checked for sense.

torch's DCP reader trusts ``.metadata`` completely: it unpickles it with plain ``pickle`` and allocates
every tensor it describes before reading a byte of data. Here the opcodes are checked first (the C
unpickler allocates a memo index or a counted length before it reads the bytes), globals are
limited to DCP's metadata classes, and the result is checked before anything is allocated from it:
tensor sizes within the bytes the folder holds, planner paths of plain keys, storage entries that are
offsets into the folder's files.
"""

from __future__ import annotations

import enum
import io
import math
import pickle
import pickletools
import struct
from pathlib import Path
from typing import Any, Final

import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from .._core.errors import CheckpointCorruptError, NotACheckpointError, UnsafeCheckpointError
from .._core.text import article
from .._core.types import PathLike

__all__ = ["METADATA", "read_dcp_metadata"]

METADATA: Final = ".metadata"
_ALLOWED: Final = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}
_MEMO_OPS: Final = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_MAX_PATH_INDEX: Final = 1 << 20  # a list position in a planner path (optimizer param ids, groups)


def _check_opcodes(data: bytes) -> None:
    """Every counted length fits in the file (genops reads, never allocates) and every memo index is one a
    sane pickle could have written (the C unpickler grows its memo table to a damaged index at once)."""
    count = 0
    for op, arg, _ in pickletools.genops(data):
        count += 1
        if op.name in _MEMO_OPS and isinstance(arg, int) and not 0 <= arg <= count:
            raise ValueError(f"memo index {arg} at opcode {count}")


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``getattr`` may do in DCP metadata: some Python releases pickle an enum member (DCP's
    ``_MEM_FORMAT_ENCODING``) as ``getattr(EnumClass, "NAME")``; only an allowed enum's member comes back."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__name__ in _ALLOWED.get(cls.__module__, ())
    if not (allowed and isinstance(name, str) and name in cls.__members__):
        raise _NotMetadata(f"getattr({cls!r}, {name!r}) is not part of DCP metadata")
    return cls[name]


class _NotMetadata(pickle.UnpicklingError):
    """A global (or getattr) outside DCP's metadata classes: refused, never resolved."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _NotMetadata(f"global '{module}.{name}' is not part of DCP metadata")


def read_dcp_metadata(path: PathLike, *, weights_only: bool = True) -> Metadata:
    """The DCP folder's ``Metadata``, unpickled with an allowlist of DCP's own classes. Local."""
    meta_path = Path(path) / METADATA
    try:
        data = meta_path.read_bytes()
        # every counted length must fit in the file: the C unpickler allocates a BINBYTES8/FRAME length
        # it reads before it reads the bytes (8 damaged bytes ask for exabytes); genops reads, never allocates
        _check_opcodes(data)
        f = io.BytesIO(data)
        metadata = _MetadataUnpickler(f).load() if weights_only else pickle.load(f)
    except FileNotFoundError as err:
        raise NotACheckpointError(f"{str(path)!r} is not a DCP folder: it has no {METADATA} file") from err
    except _NotMetadata as err:
        raise UnsafeCheckpointError(
            f"checkpoint {str(meta_path)!r} cannot be loaded safely: {err}; if you trust the folder, pass weights_only=False"
        ) from err
    except pickle.UnpicklingError as err:
        raise CheckpointCorruptError(f"{str(meta_path)!r} is damaged ({err}); the save was interrupted") from err
    except (
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        OverflowError,
        MemoryError,
        struct.error,
    ) as err:  # MemoryError: from a file of a few KB, only a damaged count asks for that much
        raise CheckpointCorruptError(f"{str(meta_path)!r} is damaged ({err}); the save was interrupted") from err
    if not isinstance(metadata, Metadata):
        raise NotACheckpointError(f"{str(meta_path)!r} holds {article(type(metadata).__name__)}, not DCP Metadata")
    _check_structure(metadata, Path(path), meta_path)
    return metadata


def _damaged(meta_path: Path, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{str(meta_path)!r} is damaged ({what}); the save was interrupted or the copy is bad"
    )


def _check_structure(metadata: Metadata, folder: Path, meta_path: Path) -> None:
    """What the reader will allocate and index from ``metadata`` makes sense for this folder's files."""
    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        raise _damaged(meta_path, "no state_dict_metadata mapping")
    stored = sum(p.stat().st_size for p in folder.glob("*.distcp"))
    for fqn, md in entries.items():
        if not isinstance(fqn, str):
            raise _damaged(meta_path, f"an entry named {fqn!r}, not a str")
        if isinstance(md, TensorStorageMetadata):
            size, dtype = getattr(md, "size", None), getattr(getattr(md, "properties", None), "dtype", None)
            if not (isinstance(size, tuple) and all(isinstance(n, int) and n >= 0 for n in size)):
                raise _damaged(meta_path, f"tensor {fqn!r} has size {size!r}")
            if not isinstance(dtype, torch.dtype):
                raise _damaged(meta_path, f"tensor {fqn!r} has dtype {dtype!r}")
            if math.prod(size) * dtype.itemsize > stored + (1 << 20):
                raise _damaged(meta_path, f"tensor {fqn!r} of size {tuple(size)} is larger than the folder's data")
        elif not isinstance(md, BytesStorageMetadata):
            raise NotACheckpointError(
                f"DCP entry {fqn!r} is {article(type(md).__name__)}; only tensors and objects load"
            )
    planner_data = getattr(metadata, "planner_data", None) or {}
    if not isinstance(planner_data, dict):
        raise _damaged(meta_path, "planner_data is not a mapping")
    for fqn, path in planner_data.items():
        if (
            not isinstance(path, (tuple, list))
            or not path
            or not all(isinstance(k, str) or (type(k) is int and 0 <= k < _MAX_PATH_INDEX) for k in path)
        ):
            raise _damaged(meta_path, f"the planner path of {fqn!r} is {path!r}")
    for index, info in (getattr(metadata, "storage_data", None) or {}).items():
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        relative = getattr(info, "relative_path", None)
        if not (type(offset) is int and type(length) is int and offset >= 0 and length >= 0):
            raise _damaged(meta_path, f"storage entry {index!r} has offset {offset!r} and length {length!r}")
        if not isinstance(relative, str) or "/" in relative or relative.startswith("."):
            raise _damaged(meta_path, f"storage entry {index!r} names the file {relative!r}")
