"""A DCP ``.metadata`` read without torch: the same allowlist as torch's path, stand-ins instead of DCP's classes.

``.metadata`` is a pickle of ``torch.distributed.checkpoint.metadata.Metadata``. :func:`peek_dcp_metadata` unpickles
it with the globals :mod:`~dist_resume._foreign.dcp_metadata` allows (DCP's metadata classes, ``torch.Size``, torch's
dtypes, ``_get_layout``, paths, ``OrderedDict``, an allowed enum's member through ``getattr``), each one a
:class:`Stand` that records the state the pickle gives it and nothing more: no code runs, nothing is allocated from a
count. Its attributes read as the real objects' do, so one walk (:func:`~dist_resume._format.dcp.view.view_of`)
describes a real ``Metadata`` and a peeked one alike. ``dist-resume list`` checks a sharded folder's ``.metadata``
this way without importing torch; torch's own path reads the same bytes with the real classes.

:func:`check_opcodes` is the check both paths run first: every counted length fits in the file and every memo index
is one a sane pickle could have written (the C unpickler grows its memo table to a damaged index at once).

Torch-free: this module imports nothing but the standard library.
"""

from __future__ import annotations

import io
import pickle
import pickletools
import struct
from collections import OrderedDict
from typing import Any, ClassVar, Final

__all__ = ["DTYPE_SIZES", "ALLOWED", "DAMAGED_PICKLE", "NotMetadata", "Stand", "check_opcodes", "peek_dcp_metadata"]

# torch's dtypes by their attribute name in ``torch`` and their bytes per element (tests/test_dcp_metadata.py checks
# the table against torch); sub-byte and bit dtypes count one byte
DTYPE_SIZES: Final = {
    **dict.fromkeys(("float64", "double", "int64", "long", "complex64", "cfloat", "uint64"), 8),
    **dict.fromkeys(("float32", "float", "int32", "int", "complex32", "chalf", "uint32", "qint32"), 4),
    **dict.fromkeys(("float16", "half", "bfloat16", "int16", "short", "uint16", "bits16"), 2),
    **dict.fromkeys(("complex128", "cdouble"), 16),
    **dict.fromkeys(
        ("int8", "uint8", "bool", "qint8", "quint8", "quint4x2", "quint2x4", "bits8", "bits1x8", "bits2x4", "bits4x2")
        + ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
        + tuple(f"int{n}" for n in range(1, 8))
        + tuple(f"uint{n}" for n in range(1, 8))
        + ("bit",),
        1,
    ),
}
ALLOWED: Final = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}),
    "collections": frozenset({"OrderedDict"}),
}
# what unpickling a damaged pickle raises (MemoryError: from a file of a few KB, only a damaged count asks for that much)
DAMAGED_PICKLE: Final = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    OverflowError,
    MemoryError,
    RecursionError,
    struct.error,
)
_ENUMS: Final = frozenset({"_MEM_FORMAT_ENCODING"})
_MEMO_OPS: Final = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "GET", "BINGET", "LONG_BINGET"})
_PROPERTIES: Final = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")  # TensorProperties' state


def check_opcodes(data: bytes) -> None:
    """ValueError unless every counted length of the pickle ``data`` fits in it (``genops`` reads, never allocates)
    and every memo index is one a sane pickle could have written."""
    count = 0
    for op, arg, _ in pickletools.genops(data):
        count += 1
        if op.name in _MEMO_OPS and isinstance(arg, int) and not 0 <= arg <= count:
            raise ValueError(f"memo index {arg} at opcode {count}")


class NotMetadata(pickle.UnpicklingError):
    """A global (or getattr) outside DCP's metadata classes: refused, never resolved."""


class Stand:
    """One of DCP's metadata objects as the pickle describes it: its class's name and its state, read as attributes
    (``TensorProperties`` unpacks its state tuple as the real class does). Holds data only."""

    __slots__ = ("_args", "_name", "_state")

    def __init__(self, name: str, args: tuple[Any, ...] = ()) -> None:
        self._name, self._args = name, args
        self._state: dict[str, Any] = {}

    def __setstate__(self, state: Any) -> None:
        if self._name == "TensorProperties" and isinstance(state, tuple) and len(state) == len(_PROPERTIES):
            state = dict(zip(_PROPERTIES, state))
        if not isinstance(state, dict):
            raise NotMetadata(f"{self._name} with the state {type(state).__name__}")
        self._state = state

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._state[name]
        except KeyError:
            raise AttributeError(f"{self._name} has no {name}") from None

    @property
    def kind(self) -> str:
        """The class name it stands for (``TensorStorageMetadata``, ...)."""
        return self._name

    @property
    def args(self) -> tuple[Any, ...]:
        return self._args


class Dtype:
    """A torch dtype named in the pickle: its name and ``itemsize``, as ``torch.dtype`` has them."""

    __slots__ = ("itemsize", "name")

    def __init__(self, name: str) -> None:
        self.name, self.itemsize = name, DTYPE_SIZES[name]


class _StandClass:
    """What the pickle gets for one of DCP's classes: NEWOBJ calls ``cls.__new__(cls, *args)``, REDUCE ``cls(*args)``;
    both make a :class:`Stand`."""

    stands_for: ClassVar[str] = ""

    def __new__(cls, *args: Any) -> Stand:  # type: ignore[misc]
        return Stand(cls.stands_for, args)


def _stand_class(name: str) -> type[_StandClass]:
    return type(name, (_StandClass,), {"stands_for": name})


def _size(dims: Any = ()) -> tuple[int, ...]:
    if not isinstance(dims, (tuple, list)) or not all(type(n) is int for n in dims):
        raise NotMetadata(f"torch.Size({dims!r})")
    return tuple(dims)


def _enum_member(cls: Any, name: Any) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, _StandClass) and cls.stands_for in _ENUMS):
        raise NotMetadata(f"getattr({cls!r}, {name!r}) is not part of DCP metadata")
    if not isinstance(name, str):
        raise NotMetadata(f"getattr({cls.stands_for}, {name!r}) is not part of DCP metadata")
    return Stand(f"{cls.stands_for}.{name}")


class _Peeker(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            if module == "torch":
                return _size
            if module == "collections":
                return OrderedDict
            return _stand_class(name)
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return _enum_member
        if module == "torch" and name in DTYPE_SIZES:
            return Dtype(name)
        raise NotMetadata(f"global '{module}.{name}' is not part of DCP metadata")


def peek_dcp_metadata(data: bytes) -> Any:
    """The ``Metadata`` pickled in ``data`` as :class:`Stand` objects (``torch.Size`` as a tuple of ints, a dtype as
    :class:`Dtype`). Raises :class:`NotMetadata` for a global outside the allowlist, ValueError (and the unpickler's
    own errors) for a damaged pickle; the caller words both."""
    check_opcodes(data)
    return _Peeker(io.BytesIO(data)).load()
