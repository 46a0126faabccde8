"""Where a DCP ``.metadata`` says each entry's bytes are, checked before a byte of them is read.

Each storage entry names a file, an offset, a length and the transforms its bytes went through. :func:`stored_entry`
types one (a transform torch cannot undo is refused here, not when a reader meets it); :func:`storage_problem` says
what in all of them cannot be the truth about a folder's data files: bytes in a file the folder does not hold or past
its end, two entries over the same bytes (one entry read as another's: a wrong value restored without a word), an
entry that names no tensor chunk or object ``.metadata`` declares (an entry whose declaration was lost).

Torch-free: this module imports nothing but the standard library and :mod:`.._core.text`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..._core.bounds import MAX_INT64
from ..._core.text import described

__all__ = ["ZSTD", "StorageProblem", "Stored", "stored_entry", "storage_problem"]

ZSTD: Final = "stream.zstd"  # the one stream transform torch 2.13 reads (its ExtensionRegistry's ZStandard)
_MAX_TRANSFORMS: Final = 4

Dims = tuple[int, ...]
Key = tuple[str, Dims | None]  # a tensor chunk's (fqn, offsets), an object's (fqn, None)


class StorageProblem(ValueError):
    """A storage entry holds something that is not what DCP writes (the message says what)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Where an entry's bytes are: the file, the offset, the length; ``transforms``: what they went through (a
    compressed entry's ``stream.zstd/1``), undone in reverse order when read."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()

    @property
    def transformed(self) -> bool:
        return bool(self.transforms)


def _kind(obj: Any) -> str:
    return str(getattr(obj, "kind", None) or type(obj).__name__)


def _known_transform(descriptor: Any) -> bool:
    """Whether torch's reader can undo ``descriptor``: ``stream.zstd/1`` (any 1.x), as its ExtensionRegistry reads."""
    if type(descriptor) is not str:
        return False
    name, _, version = descriptor.partition("/")
    return name == ZSTD and version.partition(".")[0] == "1"


def stored_entry(index: Any, info: Any, dims: Any) -> tuple[Key, Stored]:
    """One storage entry (``MetadataIndex`` -> ``_StorageInfo``) as ``((fqn, offsets), Stored)``, every field typed;
    :class:`StorageProblem` naming the entry otherwise. ``dims`` types a chunk's offsets (the view's own check)."""
    fqn, at = getattr(index, "fqn", None), getattr(index, "offset", None)
    if _kind(index) != "MetadataIndex" or type(fqn) is not str:
        raise StorageProblem(f"a storage key {described(index)}")
    offsets = None if at is None else dims(at, f"the storage offset of {fqn!r}")
    name, offset, length = (getattr(info, a, None) for a in ("relative_path", "offset", "length"))
    transforms = getattr(info, "transform_descriptors", None)
    if (
        _kind(info) != "_StorageInfo"
        or type(name) is not str
        or not (type(offset) is int and type(length) is int and 0 <= offset <= MAX_INT64 and 0 <= length <= MAX_INT64)
        or not (transforms is None or isinstance(transforms, (list, tuple)))
    ):
        raise StorageProblem(f"the storage entry of {fqn!r} is {described(info)}")
    if transforms and (len(transforms) > _MAX_TRANSFORMS or not all(map(_known_transform, transforms))):
        raise StorageProblem(
            f"the storage entry of {fqn!r} has the transforms {described(transforms)}; torch's DCP reader undoes "
            f"only {ZSTD}/1 (zstd compression)"
        )
    return (fqn, offsets), Stored(name, offset, length, tuple(transforms or ()))


def _who(key: Key) -> str:
    fqn, offsets = key
    return repr(fqn) if offsets is None else f"{fqn!r} at {offsets}"


def storage_problem(declared: set[Key], entries: Mapping[Key, Stored], sizes: Mapping[str, int]) -> str | None:
    """What in the storage ``entries`` cannot be the truth about a folder whose data files are ``sizes`` (name:
    bytes) and whose ``.metadata`` declares the tensor chunks and objects ``declared``, or None. Local."""
    by_file: dict[str, list[tuple[int, int, Key]]] = {}
    for key, stored in entries.items():
        if key not in declared:
            return (
                f"the storage entry of {_who(key)} names no tensor chunk or object its state_dict_metadata declares "
                "(an entry lost its declaration)"
            )
        if stored.file not in sizes:
            return f"the bytes of {key[0]!r} are in {stored.file!r}, which is not one of the folder's data files"
        if stored.offset + stored.length > sizes[stored.file]:
            return (
                f"the bytes of {key[0]!r} run past the end of {stored.file!r} ({stored.offset} + {stored.length} > "
                f"{sizes[stored.file]} bytes)"
            )
        if stored.length:
            by_file.setdefault(stored.file, []).append((stored.offset, stored.offset + stored.length, key))
    for name, ranges in by_file.items():
        ranges.sort(key=lambda r: (r[0], r[1]))
        for (start, end, first), (later, _, second) in itertools.pairwise(ranges):
            if later < end:
                return (
                    f"the storage entries of {_who(first)} and {_who(second)} share bytes of {name!r} "
                    f"([{start}, {end}) and from {later}): one entry's bytes would be read as another's"
                )
    return None
