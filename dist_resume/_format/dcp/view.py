"""What a DCP ``.metadata`` promises, checked against the folder's files before a byte of data is read.

torch's DCP reader trusts ``.metadata`` completely: it allocates every tensor it describes, reads each chunk from the
file and offset it names, and fills only the elements some chunk covers (an element no chunk covers keeps whatever
memory held). :func:`view_of` turns a ``Metadata`` (torch's, or :mod:`.peek`'s stand-ins: the same walk) into a
:class:`DcpView` of plain values, every field typed first; :func:`view_problem` says what in it cannot be the truth
about a folder holding ``sizes``: a chunk outside its tensor, chunks that do not cover every element exactly once
(:mod:`.cover`), a chunk larger than the bytes stored for it, storage entries that share bytes, lie outside the
folder's data files or name nothing declared (:mod:`.storage`), an entry without stored bytes, planner paths that
cannot all be places in one nested state or that name no entry.

Torch-free: this module imports nothing but the standard library and :mod:`.._core.text`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..._core.bounds import MAX_INT64
from ..._core.text import described
from .cover import cover_problem
from .peek import DAMAGED_PICKLE, NotMetadata, peek_dcp_metadata
from .storage import StorageProblem, Stored, storage_problem, stored_entry

__all__ = [
    "BadMetadata",
    "Chunk",
    "TensorEntry",
    "Stored",
    "DcpView",
    "view_of",
    "view_problem",
    "metadata_view",
    "metadata_problem",
]

MAX_PATH_INDEX: Final = 1 << 20  # a list position in a planner path (optimizer param ids, groups)
_MAX_DEPTH: Final = 64  # planner paths: a state dict nests a handful of levels
_MAX_DIMS: Final = 64
_SLACK: Final = 1 << 20  # a compressed entry may hold more elements than its bytes: bounded by the folder's bytes

Dims = tuple[int, ...]
Place = tuple[str | int, ...]


class BadMetadata(ValueError):
    """``.metadata`` holds something that cannot be DCP's metadata (the message says what)."""


@dataclass(frozen=True, slots=True)
class Chunk:
    """One saved piece of a tensor: where it starts and its extent in each dimension."""

    offsets: Dims
    sizes: Dims


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """A tensor as ``.metadata`` declares it: its full size, its dtype (torch's name without ``torch.``), the bytes
    per element, its chunks."""

    size: Dims
    dtype: str
    itemsize: int
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True, slots=True)
class DcpView:
    """``.metadata`` as plain values: each tensor, each object entry, every entry's place in the nested state, and
    the stored bytes of each (tensor chunk: ``(fqn, offsets)``; object: ``(fqn, None)``)."""

    tensors: dict[str, TensorEntry]
    objects: tuple[str, ...]
    places: dict[str, Place]
    stored: dict[tuple[str, Dims | None], Stored]

    @property
    def files(self) -> set[str]:
        return {s.file for s in self.stored.values()}

    @property
    def top_level(self) -> set[str | int]:
        return {place[0] for place in self.places.values()}


def _kind(obj: Any) -> str:
    return str(getattr(obj, "kind", None) or type(obj).__name__)


def _dims(value: Any, what: str) -> Dims:
    if (
        not isinstance(value, tuple)
        or len(value) > _MAX_DIMS
        or not all(type(n) is int and 0 <= n <= MAX_INT64 for n in value)
    ):
        raise BadMetadata(f"{what} is {described(value)}, not a tuple of sizes")
    return tuple(value)


def _tensor(fqn: str, md: Any) -> TensorEntry:
    size = _dims(getattr(md, "size", None), f"the size of tensor {fqn!r}")
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    itemsize = getattr(dtype, "itemsize", None)
    if type(dtype).__name__ not in ("dtype", "Dtype") or type(itemsize) is not int or itemsize < 1:
        raise BadMetadata(f"tensor {fqn!r} has the dtype {described(dtype)}")
    raw = getattr(md, "chunks", None)
    if not isinstance(raw, list):
        raise BadMetadata(f"tensor {fqn!r} has chunks {type(raw).__name__}, not a list")
    chunks = []
    for chunk in raw:
        if _kind(chunk) != "ChunkStorageMetadata":
            raise BadMetadata(f"tensor {fqn!r} has a chunk that is {_kind(chunk)}")
        offsets = _dims(getattr(chunk, "offsets", None), f"a chunk offset of {fqn!r}")
        sizes = _dims(getattr(chunk, "sizes", None), f"a chunk size of {fqn!r}")
        chunks.append(Chunk(offsets, sizes))
    return TensorEntry(size, _dtype_name(dtype), itemsize, tuple(chunks))


def _dtype_name(dtype: Any) -> str:
    """``float32`` for ``torch.float32`` and for :mod:`.peek`'s stand-in of it alike."""
    name = getattr(dtype, "name", None) if type(dtype).__name__ == "Dtype" else str(dtype).removeprefix("torch.")
    return str(name)


def _place(fqn: str, path: Any) -> Place:
    if path is None:
        return (fqn,)
    if (
        not isinstance(path, (tuple, list))
        or not path
        or len(path) > _MAX_DEPTH
        or not all(type(k) is str or (type(k) is int and 0 <= k < MAX_PATH_INDEX) for k in path)
        or type(path[0]) is not str
        or ".".join(map(str, path)) != fqn  # DCP's key of a nested entry is its path joined by dots
    ):
        raise BadMetadata(f"the planner path of {fqn!r} is {described(path)}")
    return tuple(path)


def view_of(metadata: Any) -> DcpView:
    """``metadata`` (a DCP ``Metadata`` or its stand-in) as a :class:`DcpView`, every field typed; :class:`BadMetadata`
    naming the first field that is not what DCP writes. Local."""
    entries = getattr(metadata, "state_dict_metadata", None)
    planner = getattr(metadata, "planner_data", None)
    storage = getattr(metadata, "storage_data", None)
    if _kind(metadata) != "Metadata" or not isinstance(entries, dict):
        raise BadMetadata(f"it holds {_kind(metadata)} without a state_dict_metadata mapping")
    if planner is not None and not isinstance(planner, dict):
        raise BadMetadata(f"planner_data is {type(planner).__name__}, not a mapping")
    if not isinstance(storage, dict):
        raise BadMetadata(f"storage_data is {type(storage).__name__}, not a mapping")
    tensors: dict[str, TensorEntry] = {}
    objects: list[str] = []
    places: dict[str, Place] = {}
    for fqn, md in entries.items():
        if type(fqn) is not str:
            raise BadMetadata(f"an entry named {described(fqn)}, not a str")
        if _kind(md) == "TensorStorageMetadata":
            tensors[fqn] = _tensor(fqn, md)
        elif _kind(md) == "BytesStorageMetadata":
            objects.append(fqn)
        else:
            raise BadMetadata(f"entry {fqn!r} is {_kind(md)}; only tensors and objects load")
        places[fqn] = _place(fqn, (planner or {}).get(fqn))
    lost = [fqn for fqn in planner or () if fqn not in entries]
    if lost:
        raise BadMetadata(f"planner_data places {described(lost[0])}, which has no entry in state_dict_metadata")
    try:
        stored = dict(stored_entry(index, info, _dims) for index, info in storage.items())
    except StorageProblem as err:
        raise BadMetadata(str(err)) from None
    return DcpView(tensors, tuple(objects), places, stored)


def _tree_problem(places: Mapping[str, Place]) -> str | None:
    """Whether every entry can take its place in one nested state: no place inside another's value, no two entries
    at one place, and the keys below any one place all names or all list positions."""
    leaves: dict[Place, str] = {}
    inner: dict[Place, type] = {}
    for fqn, place in places.items():
        if place in leaves or place in inner:
            return f"entries {leaves.get(place, '?')!r} and {fqn!r} share the place {place!r}"
        leaves[place] = fqn
        for depth in range(1, len(place)):
            prefix, key = place[:depth], place[depth]
            if prefix in leaves:
                return f"entry {fqn!r} is placed inside entry {leaves[prefix]!r}"
            if inner.setdefault(prefix, type(key)) is not type(key):
                return f"the keys below {prefix!r} mix names and list positions ({fqn!r})"
    return None


def view_problem(view: DcpView, sizes: Mapping[str, int]) -> str | None:
    """What in ``view`` cannot be the truth about a folder whose data files (``.distcp``) are ``sizes`` (name: bytes);
    None when everything adds up. Local."""
    tree = _tree_problem(view.places)
    if tree is not None:
        return tree
    declared = {(fqn, c.offsets) for fqn, entry in view.tensors.items() for c in entry.chunks}
    storage = storage_problem(declared | {(fqn, None) for fqn in view.objects}, view.stored, sizes)
    if storage is not None:
        return storage
    for fqn in view.objects:
        if (fqn, None) not in view.stored:
            return f"object {fqn!r} has no stored bytes"
    everything = sum(sizes.values()) + _SLACK
    for fqn, entry in view.tensors.items():
        cover = cover_problem(entry.size, entry.chunks)
        if cover is not None:
            return f"tensor {fqn!r} of size {entry.size}: {cover}"
        for chunk in entry.chunks:
            at = view.stored.get((fqn, chunk.offsets))
            if at is None:
                return f"the chunk of {fqn!r} at {chunk.offsets} has no stored bytes"
            need = math.prod(chunk.sizes) * entry.itemsize
            if need > (everything if at.transformed else at.length):
                return f"the chunk of {fqn!r} at {chunk.offsets} needs {need} bytes, {at.length} are stored"
    return None


def metadata_view(data: bytes, sizes: Mapping[str, int], contents: Iterable[str]) -> DcpView:
    """The ``.metadata`` bytes ``data`` of a sharded checkpoint folder whose shards are ``sizes`` and whose DCP state
    holds ``contents`` (the manifest's), read without torch and checked (:func:`view_problem`); :class:`BadMetadata`
    saying what is wrong otherwise. Local."""
    try:
        view = view_of(peek_dcp_metadata(data))
    except NotMetadata as err:
        raise BadMetadata(f"{err}: not what torch.distributed.checkpoint writes") from None
    except BadMetadata:
        raise
    except DAMAGED_PICKLE as err:
        raise BadMetadata(f"it is not a pickle DCP wrote ({type(err).__name__}: {str(err)[:100]})") from None
    problem = view_problem(view, sizes)
    if problem is None and view.top_level != set(contents):
        problem = f"it holds the entries {sorted(map(str, view.top_level))}, the manifest {sorted(contents)}"
    if problem is not None:
        raise BadMetadata(problem)
    return view


def metadata_problem(data: bytes, sizes: Mapping[str, int], contents: Iterable[str]) -> str | None:
    """What :func:`metadata_view` finds wrong with ``data``, or None. Local."""
    try:
        metadata_view(data, sizes, contents)
    except BadMetadata as err:
        return str(err)
    return None
