"""Reading a torch zip checkpoint without loading tensor data (its records and their integrity: :mod:`.records`).

``torch.save`` writes a zip archive: ``<name>/data.pkl`` (the pickled structure), one stored record
``<name>/data/<key>`` per storage (raw bytes, 64-byte aligned), plus ``version``, ``byteorder``,
``.format_version``, ``.storage_alignment`` and ``.data/serialization_id``. :func:`read_archive`
unpickles ``data.pkl`` with torch's own ``weights_only`` unpickler, so exactly what
``torch.load(weights_only=True)`` refuses is refused here too, but every storage becomes a
zero-byte ``meta`` storage: tensors come back as meta tensors with the right shape, dtype and
strides, and no tensor byte is read.
"""

from __future__ import annotations

import io
import pickle
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.location import Location, looked_up
from .._core.security import warn_if_unsafe_torch
from .._core.tensor_kind import refuse_odd_tensors
from .._core.torch_compat.private import (
    WeightsOnlyUnpickler,
    allowing_plain_globals,
    decode_location,
    discarding_sparse_checks,
    meta_typed_storage,
    storage_class_of,
    storage_id,
)
from .._core.torch_compat.wording import is_garbled_pickle
from .records import Record
from .small_records import read_checked_records
from .sniff import check_walkable, unsafe_error

__all__ = ["StorageInfo", "ArchiveContents", "read_archive"]


@dataclass(frozen=True, slots=True)
class StorageInfo:
    """One storage referenced by ``data.pkl``: what ``torch.load`` would allocate for it."""

    key: str
    dtype: torch.dtype
    location: str  # the device tag it was saved with: "cpu", "cuda:3", ...
    numel: int
    nbytes: int
    pid: tuple[Any, ...]  # the persistent id to emit when re-pickling; its storage class is a real torch class


@dataclass
class ArchiveContents:
    """The structure of a checkpoint with meta tensors in place of data, and where the data lives."""

    path: Location
    archive_name: str
    records: list[Record]
    pickle_size: int
    obj: Any
    storages: dict[str, StorageInfo]
    _by_cdata: dict[int, StorageInfo] = field(default_factory=dict, repr=False)
    _keepalive: list[torch.UntypedStorage] = field(default_factory=list, repr=False)

    @property
    def pickle_record(self) -> str:
        return f"{self.archive_name}/data.pkl"

    def storage_of(self, tensor: torch.Tensor) -> StorageInfo | None:
        """The saved storage behind a tensor of :attr:`obj`, or None (a tensor saved without storage)."""
        if not tensor.is_meta:
            return None
        return self._by_cdata.get(storage_id(tensor.untyped_storage()))

    def register(self, storage: torch.UntypedStorage, info: StorageInfo) -> None:
        """Record that the meta ``storage`` stands for the saved storage ``info`` (what re-pickling emits)."""
        self.storages[info.key] = info
        self._by_cdata[storage_id(storage)] = info
        self._keepalive.append(storage)


def _name(path: Location) -> str:
    return repr(str(path))


class _Garbled(pickle.UnpicklingError):
    """data.pkl is not what torch.save writes (raised by the persistent_load below)."""


class _MetaUnpickler(WeightsOnlyUnpickler):  # type: ignore[misc]
    """torch's weights_only unpickler, with every storage replaced by a zero-byte meta storage."""

    def __init__(self, data: bytes, contents: ArchiveContents) -> None:
        super().__init__(io.BytesIO(data), encoding="utf-8")
        self._contents = contents
        self._typed: dict[str, torch.storage.TypedStorage] = {}

    def persistent_load(self, pid: Any) -> torch.storage.TypedStorage:
        if not (isinstance(pid, tuple) and len(pid) == 5):
            raise _Garbled(f"unexpected persistent id {pid!r}")
        _, storage_type, key, location, numel = pid
        location = decode_location(location)
        if not (isinstance(key, str) and isinstance(location, str) and isinstance(numel, int) and numel >= 0):
            raise _Garbled(f"unexpected persistent id {pid!r}")
        if key in self._typed:
            return self._typed[key]
        kind = storage_class_of(storage_type)
        if kind is None:
            raise _Garbled(f"unexpected storage type {storage_type!r}")
        dtype, cls = kind
        nbytes = numel * dtype.itemsize
        untyped = torch.UntypedStorage(nbytes, device="meta")  # type: ignore[no-untyped-call]
        info = StorageInfo(key, dtype, location, numel, nbytes, ("storage", cls, key, location, numel))
        self._contents.register(untyped, info)
        typed = meta_typed_storage(untyped, dtype)
        self._typed[key] = typed
        return typed


def read_archive(path: Location) -> ArchiveContents:
    """Unpickle a checkpoint's structure with meta tensors in place of data. Local; reads only ``data.pkl``.

    Refuses what ``torch.load(weights_only=True)`` refuses (with the global's name), before any of
    it runs. Shapes, dtypes, strides, views and ``requires_grad`` are as saved; each tensor's
    storage (key, device tag, size) is found with :meth:`ArchiveContents.storage_of`.

    Example::

        >>> torch.save({"w": torch.ones(2, 3)}, "ckpt.pt")
        >>> contents = read_archive(Path("ckpt.pt"))
        >>> contents.obj["w"].shape, contents.storages["0"].location
        (torch.Size([2, 3]), 'cpu')
    """
    p = looked_up(path)
    checked = read_checked_records(p, keep_pickle=True)  # every small record's CRC, data.pkl's included
    data = checked.pickle or b""
    contents = ArchiveContents(p, checked.archive_name, checked.records, len(data), None, {})
    warn_if_unsafe_torch()  # the unpickler below is torch's weights_only one, with its published flaws
    try:
        # the sparse checks queued are torch.load's, not ours; argparse.Namespace (``args``) carries no code
        with discarding_sparse_checks(), allowing_plain_globals():
            contents.obj = _MetaUnpickler(data, contents).load()
    except pickle.UnpicklingError as err:
        if not isinstance(err, _Garbled) and not is_garbled_pickle(err):
            raise unsafe_error(p, err) from err  # what torch.load(weights_only=True) refuses, named
        raise CheckpointCorruptError(f"checkpoint {_name(p)} has a damaged data.pkl ({err})") from err
    except (EOFError, IndexError, KeyError, struct.error, UnicodeDecodeError) as err:
        raise CheckpointCorruptError(
            f"checkpoint {_name(p)} has a damaged data.pkl ({type(err).__name__}: {str(err)[:200]}); "
            "resume from an earlier checkpoint"
        ) from err
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as err:
        raise NotACheckpointError(
            f"checkpoint {_name(p)} holds a tensor kind that cannot be described without loading it "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); "
            "load it with torch.load and re-save it instead"
        ) from err
    check_walkable(contents.obj, f"checkpoint {_name(p)}")
    refuse_odd_tensors(contents.obj, f"checkpoint {_name(p)}")
    return contents
