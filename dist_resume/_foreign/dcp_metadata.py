"""A DCP folder's ``.metadata``: unpickled through an allowlist of DCP's own classes, then checked against the folder.

torch's DCP reader trusts ``.metadata`` completely: it unpickles it with plain ``pickle`` and allocates
every tensor it describes before reading a byte of data. Here the file is opened as a regular file inside its folder
(:mod:`~dist_resume._format.safe_open`), the opcodes are checked first (the C unpickler allocates a memo index or a
counted length before it reads the bytes), globals are limited to DCP's metadata classes
(:data:`~dist_resume._format.dcp.peek.ALLOWED`, shared with the torch-free reader), and the result is checked
(:func:`~dist_resume._format.dcp.view.view_problem`) before anything is allocated from it: every chunk inside its
tensor, every element covered exactly once, each chunk's bytes stored in one of the folder's data files and inside it,
planner paths that are places in one nested state.
"""

from __future__ import annotations

import enum
import io
import pickle
from collections.abc import Mapping
from typing import Any, Final

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._core.errors import CheckpointCorruptError, NotACheckpointError, UnsafeCheckpointError
from .._core.location import Location
from .._core.text import article
from .._core.untrusted import untrusted
from .._format.dcp.peek import ALLOWED, DAMAGED_PICKLE, check_opcodes
from .._format.dcp.view import BadMetadata, view_of, view_problem
from .._format.safe_open import folder_entries, read_in_folder

__all__ = ["METADATA", "MAX_METADATA", "read_dcp_metadata", "data_file_sizes"]

METADATA: Final = ".metadata"
MAX_METADATA: Final = 1 << 30  # 1 GiB: a million chunk entries; more is no save torch wrote


def _enum_member(cls: Any, name: Any) -> Any:
    """What ``getattr`` may do in DCP metadata: some Python releases pickle an enum member (DCP's
    ``_MEM_FORMAT_ENCODING``) as ``getattr(EnumClass, "NAME")``; only an allowed enum's member comes back."""
    allowed = isinstance(cls, type) and issubclass(cls, enum.Enum) and cls.__name__ in ALLOWED.get(cls.__module__, ())
    if not (allowed and isinstance(name, str) and name in cls.__members__):
        raise _NotMetadata(f"getattr({cls!r}, {name!r}) is not part of DCP metadata")
    return cls[name]


class _NotMetadata(pickle.UnpicklingError):
    """A global (or getattr) outside DCP's metadata classes: refused, never resolved."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if name == "getattr" and module in ("builtins", "__builtin__"):
            return _enum_member
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _NotMetadata(f"global '{module}.{name}' is not part of DCP metadata")


def data_file_sizes(folder: Location) -> dict[str, int]:
    """The regular files of a DCP folder (links and special files left out: never read) but ``.metadata``, with
    their sizes: what its storage entries may name. Local."""
    return {e.name: e.size for e in folder_entries(folder) if e.regular and e.name != METADATA}


def read_dcp_metadata(path: Location, *, weights_only: bool = True, sizes: Mapping[str, int] | None = None) -> Metadata:
    """The DCP folder's ``Metadata``, unpickled with an allowlist of DCP's own classes and checked against the
    folder's data files (``sizes``: name -> bytes, e.g. a sharded folder's manifest's shards; None: the folder's
    regular files). Local."""
    folder = path
    meta_path = folder / METADATA
    try:
        data = read_in_folder(folder, METADATA, MAX_METADATA)
        # every counted length must fit in the file: the C unpickler allocates a BINBYTES8/FRAME length
        # it reads before it reads the bytes (8 damaged bytes ask for exabytes); genops reads, never allocates
        check_opcodes(data)
        f = io.BytesIO(data)
        metadata = _MetadataUnpickler(f).load() if weights_only else pickle.load(f)
    except FileNotFoundError as err:
        raise NotACheckpointError(f"{str(path)!r} is not a DCP folder: it has no {METADATA} file") from err
    except _NotMetadata as err:
        raise UnsafeCheckpointError(
            f"checkpoint {str(meta_path)!r} cannot be loaded safely: {err}; if you trust the folder, pass weights_only=False"
        ) from err
    except DAMAGED_PICKLE as err:
        raise _damaged(meta_path, f"{type(err).__name__}: {err}") from err
    if not isinstance(metadata, Metadata):
        raise NotACheckpointError(f"{str(meta_path)!r} holds {article(type(metadata).__name__)}, not DCP Metadata")
    try:
        with untrusted(f"checkpoint {str(meta_path)!r}", "its storage entries"):
            problem = view_problem(view_of(metadata), data_file_sizes(folder) if sizes is None else sizes)
    except BadMetadata as err:
        problem = str(err)
    if problem is not None:
        raise _damaged(meta_path, problem)
    return metadata


def _damaged(meta_path: Location, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{str(meta_path)!r} is damaged ({what[:300]}); the save was interrupted or the copy is bad: resume from an "
        "earlier checkpoint"
    )
