"""The structure of a torch zip checkpoint read without torch: stubs in place of tensors, for the CLI's fast paths.

``dist-resume list`` needs a checkpoint's metadata (step, epoch, world size), not its tensors, and importing
torch costs seconds. :func:`peek_archive` reads ``data.pkl`` (its CRC-32 checked first, as
:func:`~.archive.read_archive` does) with a restricted :class:`pickle.Unpickler` that knows the handful of globals
``torch.save`` writes for a state dict (``torch._utils._rebuild_tensor_v2``, the typed storage classes,
``collections.OrderedDict``): tensors become :class:`TensorStub` (storage key, dtype, shape, strides), nothing
else is built. Every opcode is checked against the few ``torch.save`` emits before anything is unpickled.

It answers only what it is sure of: anything else (another global, opcode, storage type or tensor kind (an expanded view among them), a
persistent id or arguments not as torch writes them, a tensor outside its storage, nesting past 32 levels, a
container holding itself) raises :class:`PeekUnsure`, and the caller asks torch's own reader instead, which
either reads it or says precisely what is wrong. So a fast answer is always the answer torch's path gives.

Torch-free: this module imports nothing but the standard library and the torch-free modules beside it.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Final

from .._core.location import Location
from .._core.strides import overlapping
from .records import Record
from .small_records import read_checked_records

__all__ = ["PeekUnsure", "StorageStub", "TensorStub", "Peeked", "peek_pickle", "peek_archive"]

# torch.<Name>Storage -> (dtype name, bytes per element): the typed storages torch.save names (torch 2.x)
STORAGE_DTYPES: Final = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
}
# the opcodes torch.save (pickle protocol 2) writes for nested dicts, lists, tuples, numbers, strings and tensors
_OPCODES: Final = frozenset(
    "PROTO STOP MARK GLOBAL REDUCE BUILD BINPERSID EMPTY_DICT EMPTY_LIST EMPTY_TUPLE SETITEM SETITEMS APPEND "
    "APPENDS TUPLE TUPLE1 TUPLE2 TUPLE3 BINPUT LONG_BINPUT BINGET LONG_BINGET NONE NEWTRUE NEWFALSE BININT "
    "BININT1 BININT2 LONG1 BINFLOAT BINUNICODE".split()
)
_MAX_DEPTH: Final = 32  # a state dict nests 3 to 6 deep; deeper is left to torch's reader and its own limit
_PLAIN: Final = (type(None), bool, int, float, str)


class PeekUnsure(Exception):
    """The file is not one the torch-free reader understands; ask torch's reader (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class StorageStub:
    """One storage ``data.pkl`` refers to: its record key, dtype, device tag and size in elements."""

    key: str
    dtype: str  # "float32", ...: torch's name without "torch."
    itemsize: int
    location: str
    numel: int


@dataclass(frozen=True, slots=True)
class TensorStub:
    """A tensor as ``data.pkl`` describes it (a view of a storage); no byte of it is read."""

    storage: StorageStub
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool

    @property
    def numel(self) -> int:
        n = 1
        for size in self.shape:
            n *= size
        return n

    @property
    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True, slots=True)
class Peeked:
    """What :func:`peek_archive` read: the unpickled structure (tensors as stubs) and the archive's records."""

    path: Location
    archive_name: str
    records: list[Record]
    obj: Any


class _Token:
    """What the unpickler hands to the pickle for a storage type, a storage or a tensor: opaque and unchangeable.

    ``BUILD`` on one calls ``__setstate__``, which refuses; it is replaced by the stub it holds once the whole pickle
    is read (:func:`_finish`), so no opcode can reach a stub and change it."""

    __slots__ = ("stub",)
    stub: Any

    def __init__(self, stub: Any) -> None:
        object.__setattr__(self, "stub", stub)

    def __setattr__(self, name: str, value: Any) -> None:
        raise PeekUnsure("a pickle that sets attributes of a tensor or storage")

    def __setstate__(self, state: Any) -> None:
        raise PeekUnsure("a pickle that sets the state of a tensor or storage")


def _unwrap(value: Any, kind: type) -> Any:
    if type(value) is not _Token or not isinstance(value.stub, kind):
        raise PeekUnsure(f"a {kind.__name__} expected where the pickle has {type(value).__name__}")
    return value.stub


def _ints(value: Any) -> bool:
    return isinstance(value, tuple) and all(type(v) is int and v >= 0 for v in value)


def _rebuild_tensor_v2(*args: Any) -> _Token:
    if len(args) not in (6, 7) or (len(args) == 7 and args[6] is not None):
        raise PeekUnsure(f"a tensor rebuilt from {len(args)} arguments")
    storage, offset, shape, stride, requires_grad, hooks = _unwrap(args[0], StorageStub), *args[1:6]
    if not (type(offset) is int and offset >= 0 and _ints(shape)):
        raise PeekUnsure("a tensor whose storage, offset or shape is not as torch.save writes them")
    if not (_ints(stride) and len(stride) == len(shape) and type(requires_grad) is bool):
        raise PeekUnsure("a tensor whose strides or requires_grad are not as torch.save writes them")
    if type(hooks) is not OrderedDict or hooks:
        raise PeekUnsure("a tensor saved with backward hooks")
    tensor = TensorStub(storage, offset, shape, stride, requires_grad)
    if tensor.numel and offset + sum((n - 1) * s for n, s in zip(shape, stride)) >= storage.numel:
        raise PeekUnsure("a tensor reaching past the end of its storage")
    if overlapping(shape, stride):  # the torch path refuses it by kind (_core/tensor_kind.py)
        raise PeekUnsure("a tensor whose elements share memory (an expanded view)")
    return _Token(tensor)


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._storages: dict[str, StorageStub] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor_v2
        if module == "torch" and name in STORAGE_DTYPES:
            return _Token(STORAGE_DTYPES[name])
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise PeekUnsure(f"the global {module}.{name}")

    def persistent_load(self, pid: Any) -> _Token:
        if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
            raise PeekUnsure("a persistent id not as torch.save writes it")
        _, kind, key, location, numel = pid
        dtype, itemsize = _unwrap(kind, tuple)
        if type(key) is not str or type(location) is not str or type(numel) is not int or numel < 0:
            raise PeekUnsure("a persistent id not as torch.save writes it")
        stub = StorageStub(key, dtype, itemsize, location, numel)
        if self._storages.setdefault(key, stub) != stub:
            raise PeekUnsure(f"the storage {key!r} named twice with different types or sizes")
        return _Token(stub)


def _check_opcodes(data: bytes) -> None:
    try:
        for op, _, _ in pickletools.genops(data):
            if op.name not in _OPCODES:
                raise PeekUnsure(f"the pickle opcode {op.name}")
    except (ValueError, IndexError, TypeError) as err:  # not a pickle genops can read: torch's reader says why
        raise PeekUnsure(f"data.pkl does not parse ({err})") from err


def _finish(obj: Any, depth: int, on_path: set[int]) -> Any:
    """``obj`` with every tensor token replaced by its :class:`TensorStub`, or :class:`PeekUnsure` for anything but
    dicts, lists, tuples, plain values and tensors (a stray storage, a class or function as a value, a dict keyed by
    a tensor, attributes set on an OrderedDict other than its ``_metadata``), nesting past 32 levels or a cycle."""
    if type(obj) is _Token:
        return _unwrap(obj, TensorStub)
    if type(obj) in _PLAIN:
        return obj
    if type(obj) not in (dict, OrderedDict, list, tuple):
        raise PeekUnsure(f"a {type(obj).__name__} among the values")
    if depth > _MAX_DEPTH or id(obj) in on_path:
        raise PeekUnsure("a structure nested too deep or holding itself")
    on_path.add(id(obj))
    if type(obj) is tuple:
        done: Any = tuple(_finish(item, depth + 1, on_path) for item in obj)
    elif type(obj) is list:
        obj[:] = [_finish(item, depth + 1, on_path) for item in obj]
        done = obj
    else:
        if type(obj) is OrderedDict and set(vars(obj)) - {"_metadata"}:
            raise PeekUnsure("an OrderedDict with attributes other than _metadata")
        if any(type(k) not in _PLAIN for k in obj):
            raise PeekUnsure("a dict keyed by something other than plain values")
        for key in obj:
            obj[key] = _finish(obj[key], depth + 1, on_path)
        done = obj
    on_path.discard(id(obj))
    return done


def peek_archive(path: Location) -> Peeked:
    """``data.pkl`` of the torch zip file ``path``, unpickled with :class:`TensorStub` for tensors. Local.

    The zip structure and every small record's CRC-32 are checked first, with the errors
    :func:`~.archive.read_archive` raises for them (:class:`CheckpointError` subclasses naming the file);
    anything the stub reader does not know raises :class:`PeekUnsure`. Reads no tensor data.

    Example::

        >>> torch.save({"w": torch.ones(2, 3), "step": 3}, "ckpt.pt")
        >>> peeked = peek_archive(Path("ckpt.pt"))
        >>> peeked.obj["step"], peeked.obj["w"].shape, peeked.obj["w"].storage.dtype
        (3, (2, 3), 'float32')
    """
    p = path
    checked = read_checked_records(p, keep_pickle=True)
    return Peeked(p, checked.archive_name, checked.records, peek_pickle(checked.pickle or b""))


def peek_pickle(data: bytes) -> Any:
    """``data.pkl``'s bytes ``data`` (CRC-32 checked by the caller) unpickled with :class:`TensorStub` for tensors;
    :class:`PeekUnsure` for anything the stub reader does not know. Local."""
    _check_opcodes(data)
    try:
        obj = _StubUnpickler(data).load()
    except PeekUnsure:
        raise
    except Exception as err:  # a damaged pickle that genops walked: torch's reader words the refusal
        raise PeekUnsure(f"data.pkl does not unpickle ({type(err).__name__})") from err
    return _finish(obj, 0, set())
