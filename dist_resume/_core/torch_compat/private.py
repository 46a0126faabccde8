"""Everything dist_resume relies on that torch does not promise: its private APIs.

Each item says which torch behaviour it depends on (checked on torch 2.13). When torch changes one,
this is the one module to fix; nothing else in the package reaches into ``torch._*``,
``torch.serialization._*`` or ``torch._utils._*``. The wording of torch's errors is read in
:mod:`dist_resume._core.torch_compat.wording`, and nowhere else.
"""

from __future__ import annotations

import argparse
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import _weights_only_unpickler as _wo
from torch import nn

__all__ = [
    "WeightsOnlyUnpickler",
    "allowing_plain_globals",
    "compiled_original",
    "default_store",
    "group_timeout",
    "decode_location",
    "discarding_sparse_checks",
    "meta_typed_storage",
    "object_collective_device_type",
    "storage_class_for",
    "storage_class_of",
    "storage_id",
    "tensor_owners",
    "tensor_reduction",
    "zstd_available",
    "dtensor_with_local",
]

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


def object_collective_device_type(group: Any = None) -> str:
    """The device type torch's own object collectives (``broadcast_object_list``) use on ``group`` (None: the default):
    torch.distributed.distributed_c10d._get_object_coll_device (torch >= 2.3) reads the group's backends'
    device types and prefers ``cpu`` when the group has one (gloo); else the one type it serves (``cuda``
    for nccl, ``xpu`` for xccl, a registered backend's device)."""
    from torch.distributed import distributed_c10d

    return str(distributed_c10d._get_object_coll_device(group))


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


def zstd_available() -> bool:
    """Whether torch's DCP reader can undo a ``stream.zstd`` transform here: its (experimental, private)
    ``_extension.ZStandard`` needs ``zstandard`` or ``pyzstd``, and raises a bare ``ValueError`` while reading without
    them, which a reader would take for damage."""
    from torch.distributed.checkpoint._extension import ZStandard

    return bool(ZStandard.is_available())


def default_store() -> Any:
    """The store of the default process group (``torch.distributed.distributed_c10d._get_default_store``, torch >= 1.13):
    the one ``init_process_group`` rendezvoused through (a ``PrefixStore`` over torchrun's TCPStore, a FileStore, ...),
    its ``timeout`` the group's. :mod:`dist_resume._dist.checkin` checks ranks in there, outside the group's collectives."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def group_timeout(group: Any) -> float | None:
    """Seconds a collective of ``group`` waits before it fails: its backends' ``options._timeout`` (the ``timeout`` of
    ``init_process_group``; per backend since torch 2.0, ``ProcessGroup._device_types`` and ``_get_backend``), the
    longest of them; None where torch no longer exposes it (the caller falls back to the store's timeout)."""
    seconds: list[float] = []
    try:
        for device_type in group._device_types:
            timeout = group._get_backend(device_type).options._timeout
            seconds.append(timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return None
    return max(seconds) if seconds else None


def dtensor_with_local(dtensor: Any, local: torch.Tensor) -> Any:
    """A DTensor of ``dtensor``'s spec (mesh, placements, global shape and stride) around ``local``, which may live on
    another device (host memory for a mesh of accelerators), no data copied. DTensor's own constructor
    (``DTensor(local_tensor, spec, requires_grad=...)``, torch >= 2.4) takes it as it is, as torch's DCP staging does
    (``torch.distributed._state_dict_utils``: it swaps ``_local_tensor`` of a copy); ``DTensor.from_local`` would move
    ``local`` back to the mesh's device."""
    cls = type(dtensor)
    return cls(local, dtensor._spec, requires_grad=False)
