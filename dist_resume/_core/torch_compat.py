"""Everything dist_resume relies on that torch does not promise: private APIs and the wording of its errors.

Each item says which torch behaviour it depends on (checked on torch 2.13). When torch changes one,
this is the one module to fix; nothing else in the package reaches into ``torch._*``,
``torch.serialization._*`` or ``torch._utils._*``, or reads torch's error messages.
"""

from __future__ import annotations

import argparse
import os
import re
import sysconfig
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch import _weights_only_unpickler as _wo
from torch import nn

__all__ = [
    "CommFailure",
    "GARBLED_PICKLE",
    "LoadFailure",
    "RefusedGlobal",
    "WeightsOnlyUnpickler",
    "classify_comm_error",
    "allowing_plain_globals",
    "classify_load_error",
    "comm_error_summary",
    "compiled_original",
    "decode_location",
    "discarding_sparse_checks",
    "error_summary",
    "is_damaged_pickle_error",
    "is_out_of_memory",
    "is_garbled_pickle",
    "meta_typed_storage",
    "storage_class_for",
    "refused_global",
    "storage_id",
    "tensor_owners",
    "storage_class_of",
    "tensor_reduction",
]

# ---------------------------------------------------------------------------------------------------
# The wording of torch's errors
# ---------------------------------------------------------------------------------------------------

# torch._weights_only_unpickler raises UnpicklingError("Weights only load failed ...") for refused
# globals AND for bytes it cannot parse; these phrases (its own messages, torch >= 2.4) mean the
# latter: damaged bytes, not a refused object.
GARBLED_PICKLE = ("Unsupported operand", "String is too long", "Expected bytes, got")


def is_garbled_pickle(err: BaseException) -> bool:
    """The weights_only unpickler choked on damaged bytes (see :data:`GARBLED_PICKLE`)."""
    return any(marker in str(err) for marker in GARBLED_PICKLE)


class LoadFailure(Enum):
    """What an exception from ``torch.load`` means, read from its text."""

    UNSAFE = "unsafe"  # weights_only refused a global
    NO_DEVICE = "no_device"  # a storage is bound for a device this process lacks
    NOT_TORCH_ARCHIVE = "not_torch_archive"  # a zip, but not one torch.save wrote
    DAMAGED = "damaged"  # truncated or corrupt bytes
    OTHER = "other"


def classify_load_error(err: BaseException) -> LoadFailure:
    """Classify an ``UnpicklingError`` or ``RuntimeError`` raised by ``torch.load`` (torch 2.6 - 2.13 wording)."""
    text = str(err)
    # torch.load(weights_only=True) wraps every unpickler error in "Weights only load failed" (torch >= 2.4)
    if "Weights only load failed" in text and not is_garbled_pickle(err):
        return LoadFailure.UNSAFE
    # torch.serialization.validate_cuda_device / _cuda_deserialize: a cuda tag without CUDA, or a
    # device index past device_count() ("CUDA error: invalid device ordinal")
    if "on a CUDA device but torch.cuda.is_available() is False" in text or "invalid device ordinal" in text:
        return LoadFailure.NO_DEVICE
    # PyTorchStreamReader (caffe2/serialize/inline_container.cc) on a zip without torch's records
    if 'hasRecord("version")' in text or "failed locating file data.pkl" in text:
        return LoadFailure.NOT_TORCH_ARCHIVE
    # PyTorchStreamReader on a truncated zip ("failed finding central directory"), and the storage
    # size checks when a truncated file is memory-mapped or read ("... storage ... bytes ...")
    # ("inline_container.cc": the same reader's other checks, e.g. "Couldn't parse the version ZZ")
    if (
        "PytorchStreamReader" in text
        or "zip archive" in text
        or "inline_container.cc" in text
        or "storage" in text.lower()
    ):
        return LoadFailure.DAMAGED
    return LoadFailure.OTHER


def error_summary(err: BaseException) -> str:
    """``Type: first line`` of a torch error, preferring the unpickler's own detail line and dropping
    torch's "This is an internal error" boilerplate (wording of torch 2.6 - 2.13)."""
    lines = str(err).splitlines() or [""]
    detail = [line for line in lines if any(m in line for m in GARBLED_PICKLE)]
    text = (detail or lines)[0].split(". This is an internal")[0]
    return f"{type(err).__name__}: {text[:200]}"


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _inside_torch_or_stdlib(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return True
    return path.startswith(_STDLIB_DIR) and "-packages" not in path[len(_STDLIB_DIR) :]


def is_damaged_pickle_error(err: BaseException) -> bool:
    """A KeyError, IndexError, TypeError, AttributeError ... out of ``torch.load`` that a damaged data.pkl
    caused, rather than a bug in code torch called back (a ``map_location`` callable).

    torch.load does not wrap what its unpickler and tensor rebuilding raise on garbled bytes (checked on
    torch 2.13: ``_rebuild_tensor_v2() missing 1 required positional argument``, ``'tuple' object has no
    attribute 'dtype'``, ``KeyError: 130`` from the memo, ``list index out of range``, ``unhashable
    type``). Such an error counts as damage only when every frame below the caller's lies in torch
    (or the standard library's pickle machinery): a frame of any other code means that code failed.
    """
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return len(frames) > 1 and all(_inside_torch_or_stdlib(f) for f in frames[1:])


def is_out_of_memory(err: BaseException) -> bool:
    """torch's allocators report exhaustion as RuntimeError ("DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory"; checked on torch 2.13): a real shortage, never a sign of a damaged file."""
    text = str(err).lower()
    return "out of memory" in text or "can't allocate memory" in text


@dataclass(frozen=True)
class RefusedGlobal:
    """The global a weights_only load refused, as torch's message names it."""

    name: str | None  # e.g. "argparse.Namespace"; a builtin comes without "builtins." ("exec")
    blocked_module: str | None = None  # set when torch blocks the whole module (os, subprocess, ...)

    @property
    def is_builtin(self) -> bool:
        return self.name is not None and "." not in self.name.strip(".")


def refused_global(err: BaseException) -> RefusedGlobal:
    """Parse torch._weights_only_unpickler's refusal: "GLOBAL x.y whose module x is blocked" (a module
    on its deny list, torch >= 2.4) or "GLOBAL x.y was not an allowed global" (torch >= 2.4)."""
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return RefusedGlobal(blocked.group(1), blocked.group(2).rstrip("."))
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    return RefusedGlobal(found.group(1) if found else None)


class CommFailure(Enum):
    """Why a torch.distributed collective raised, read from its text."""

    PEER_GONE = "peer_gone"  # a peer process closed its connection: it died or exited
    TIMEOUT = "timeout"  # nothing arrived within the process-group timeout: a peer is stuck or absent
    OTHER = "other"


# gloo's tcp transport (third_party/gloo/gloo/transport/tcp/pair.cc) reports a peer that died as
# "Connection closed by peer [addr]" (EOF), "Read error ...: Connection reset by peer" (RST) or
# "Write error ...: Broken pipe"; torch 2.4 - 2.13 raise it as a plain RuntimeError.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
# gloo: "Timed out waiting <n>ms for send/recv operation to complete" (unbound_buffer.cc);
# c10d's store and DistStoreError: "Timeout" / "timed out"; nccl's watchdog aborts the process instead.
_TIMED_OUT = ("timed out", "timeout")


def classify_comm_error(err: BaseException) -> CommFailure:
    """Classify an exception raised by a torch.distributed collective (gloo wording, torch 2.4 - 2.13)."""
    text = str(err)
    if any(marker in text for marker in _PEER_GONE):
        return CommFailure.PEER_GONE
    if any(marker in text.lower() for marker in _TIMED_OUT):
        return CommFailure.TIMEOUT
    return CommFailure.OTHER


def comm_error_summary(err: BaseException) -> str:
    """``Type: first line`` of a collective's error without gloo's source location prefix
    ("[/path/pair.cc:553] ") and its advice suffix (". This is typically caused by ..."), torch 2.4 - 2.13."""
    line = (str(err).splitlines() or [""])[0]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    line = line.split(". This is typically")[0]
    return f"{type(err).__name__}: {line[:200]}"


# ---------------------------------------------------------------------------------------------------
# Private APIs
# ---------------------------------------------------------------------------------------------------

# torch._weights_only_unpickler.Unpickler: the pure-Python unpickler behind torch.load(weights_only=True)
# (torch >= 2.0). Subclassed to unpickle data.pkl with the same allow-list, overriding persistent_load.
WeightsOnlyUnpickler: type = _wo.Unpickler


def decode_location(location: Any) -> Any:
    """A storage's location tag as ``str``: torch.serialization._maybe_decode_ascii (all torch 2.x) decodes
    the bytes that Python-2-era pickles carry; anything else is returned unchanged."""
    return torch.serialization._maybe_decode_ascii(location)


def storage_class_of(storage_type: Any) -> tuple[torch.dtype, type] | None:
    """(dtype, storage class) for the storage type in a persistent id: ``torch.UntypedStorage``, or a
    ``torch.serialization.StorageType`` whose class name comes from torch.storage._dtype_to_storage_type_map
    (torch >= 2.0); None for anything else."""
    if storage_type is torch.UntypedStorage:
        return torch.uint8, torch.UntypedStorage
    if isinstance(storage_type, torch.serialization.StorageType):
        dtype = storage_type.dtype
        return dtype, getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    return None


def storage_class_for(dtype: torch.dtype) -> tuple[type, torch.dtype]:
    """(storage class, storage dtype) torch.save names in a persistent id for a tensor of ``dtype``: the typed
    class from torch.storage._dtype_to_storage_type_map (torch >= 2.0), or ``torch.UntypedStorage`` with
    uint8 for dtypes it lacks (uint16, float8, ...), as torch.save itself does (checked on torch 2.13)."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    if name is None:
        return torch.UntypedStorage, torch.uint8
    return getattr(torch, name), dtype


def meta_typed_storage(untyped: torch.UntypedStorage, dtype: torch.dtype) -> torch.storage.TypedStorage:
    """The TypedStorage torch.load hands to tensor rebuilding; ``_internal=True`` (torch >= 2.0) silences
    the TypedStorage deprecation warning as torch.serialization itself does."""
    return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
        wrap_storage=untyped, dtype=dtype, _internal=True
    )


def storage_id(storage: torch.UntypedStorage) -> int:
    """An identity for a storage that all tensors viewing it share: ``_cdata``, the C++ StorageImpl
    pointer (all torch 2.x). ``data_ptr()`` does not do: every zero-byte meta storage has 0."""
    return int(storage._cdata)


def tensor_owners(tensor: torch.Tensor) -> int:
    """How many C++ owners the tensor's TensorImpl has: ``Tensor._use_count()`` (all torch 2.x). Its Python
    object counts once however many Python names it has; a collective's work in flight counts once more.

    Why it matters: a synchronous gloo collective returns when its work is marked complete, while the
    backend's worker thread still owns the work and its tensors for a moment (checked on torch 2.13: after
    16-44% of 2-rank broadcasts and all_gathers). When Python lets go of such a tensor first, the worker
    drops the last reference later and must take the GIL to free the tensor's Python object. If the
    interpreter is finalizing by then, CPython ends that thread inside a noexcept C++ frame and the process
    aborts ("terminate called without an active exception", SIGABRT) after a run that succeeded. It takes a
    process group that outlives ``destroy_process_group``, and a DDP model makes one (checked: gloo's
    threads still run after DDP is deleted, collected and the group destroyed)."""
    return int(tensor._use_count())  # type: ignore[attr-defined]


@contextmanager
def discarding_sparse_checks() -> Iterator[None]:
    """Drop what an unpickling run queues on torch._utils._sparse_tensors_to_validate (torch >= 2.1):
    sparse tensors that torch.load validates after loading; ours are not torch.load's."""
    pending = len(torch._utils._sparse_tensors_to_validate)
    try:
        yield
    finally:
        del torch._utils._sparse_tensors_to_validate[pending:]


def tensor_reduction(tensor: torch.Tensor, storage: Any, storage_dtype: torch.dtype) -> tuple[Any, tuple[Any, ...]]:
    """The reduction torch.Tensor._reduce_ex_internal (torch 2.x) gives a strided tensor, over ``storage``
    (pickled as its persistent id): torch._utils._rebuild_tensor_v2, or _v3 with the dtype when the
    storage is untyped; wrapped in torch._tensor._rebuild_from_type_v2 for subclasses or Python state
    (torch._utils._get_obj_state), with torch._utils.get_tensor_metadata when there is any."""
    args: tuple[Any, ...] = (
        storage,
        tensor.storage_offset(),
        tuple(tensor.size()),
        tensor.stride(),
        tensor.requires_grad,
        OrderedDict(),
    )
    metadata = torch._utils.get_tensor_metadata(tensor)  # type: ignore[no-untyped-call]
    if storage_dtype == tensor.dtype:
        func: Any = torch._utils._rebuild_tensor_v2
    else:  # a tensor over an untyped storage
        func, args = torch._utils._rebuild_tensor_v3, args + (tensor.dtype,)
    if metadata:
        args = args + (metadata,)
    state = torch._utils._get_obj_state(tensor)  # type: ignore[no-untyped-call]
    if type(tensor) is not torch.Tensor or state:
        return (torch._tensor._rebuild_from_type_v2, (func, type(tensor), args, state))
    return (func, args)


def compiled_original(model: nn.Module) -> nn.Module | None:
    """The module ``torch.compile(module)`` wrapped, or None: torch._dynamo.eval_frame.OptimizedModule
    keeps it as ``_orig_mod`` (torch >= 2.0), which is where the ``_orig_mod.`` key prefix comes from."""
    try:
        from torch._dynamo.eval_frame import OptimizedModule
    except ImportError:  # pragma: no cover - torch without dynamo
        return None
    if isinstance(model, OptimizedModule):
        inner: nn.Module = model._orig_mod
        return inner
    return None


# argparse.Namespace: a plain attribute bag (its state is a __dict__ of whatever it holds, which the
# weights_only unpickler vets as usual); it carries no code. torchvision references and timm store the
# run's ``args`` as one. torch.serialization.safe_globals (public, torch >= 2.5) allows it for one load
# without touching the process-wide list that add_safe_globals would change; the weights_only unpickler
# (torch._weights_only_unpickler, which read_archive's unpickler subclasses) consults it too.
PLAIN_GLOBALS: tuple[type, ...] = (argparse.Namespace,)


def allowing_plain_globals() -> Any:
    """A context manager under which ``weights_only`` loads accept :data:`PLAIN_GLOBALS`."""
    return torch.serialization.safe_globals(list(PLAIN_GLOBALS))
