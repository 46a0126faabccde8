"""What a path holds before torch reads it (the file's kind by its first bytes), whether what it unpickled
can be walked, and refusals worded once."""

from __future__ import annotations

from enum import Enum
from typing import Final, TypeVar

from .._core.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from .._core.location import Location, RemotePath
from .safe_open import open_checkpoint_file

__all__ = ["CHECKPOINT_SUFFIXES", "FileKind", "file_kind", "check_file", "check_walkable", "unsafe_error"]

CHECKPOINT_SUFFIXES: Final = frozenset({".pt", ".pth", ".ckpt", ".bin", ".safetensors"})
"""How a single checkpoint file is named (torch, Lightning, HF and safetensors files), as opposed to a folder."""

_T = TypeVar("_T")
_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")


class FileKind(Enum):
    """What a file holds, by its first bytes."""

    ZIP = "zip"  # torch.save since torch 1.6 (or any zip archive)
    LEGACY = "legacy"  # torch.save before 1.6, or _use_new_zipfile_serialization=False
    PICKLE = "pickle"  # a plain pickle, not written by torch.save
    EMPTY = "empty"
    UNKNOWN = "unknown"


def file_kind(path: Location) -> FileKind:
    """The :class:`FileKind` of ``path``, from its first 16 bytes. Local."""
    with open_checkpoint_file(path) as f:  # a FIFO or device node is refused, never opened for reading
        head = f.read(16)
    if not head:
        return FileKind.EMPTY
    if head.startswith(_ZIP_MAGIC):
        return FileKind.ZIP
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head:
        return FileKind.LEGACY
    if head[:1] == b"\x80":
        return FileKind.PICKLE
    return FileKind.UNKNOWN


def check_file(path: Location) -> Location:
    """Raise the right :class:`CheckpointError` when ``path`` cannot be a checkpoint; return it as a Path (or the
    :class:`~dist_resume._core.location.RemotePath` of a URL)."""
    p = path
    try:  # an object's stat is asked once, then known to every read of it
        p = p.looked_up() if isinstance(p, RemotePath) else p
        present = isinstance(p, RemotePath) or p.exists()
    except FileNotFoundError:
        present = False
    if not present:
        hint = f" (the folder {str(p.parent)!r} does not exist either)" if not p.parent.exists() else ""
        raise CheckpointNotFoundError(f"checkpoint {str(p)!r} does not exist{hint}; check the path")
    if p.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint {str(p)!r} is a folder, not a file; pass a file inside it "
            "(or a checkpoint folder to resume(), which picks the newest valid checkpoint)"
        )
    try:
        kind = file_kind(p)
    except CheckpointNotFoundError:
        raise  # removed since it was looked at (open_checkpoint_file says so)
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {err.strerror or err}; check permissions") from err
    if kind is FileKind.EMPTY:
        raise CheckpointCorruptError(
            f"checkpoint {str(p)!r} is empty (0 bytes), most likely a save that was interrupted; "
            "resume from an earlier checkpoint and delete this one"
        )
    if kind in (FileKind.UNKNOWN, FileKind.PICKLE):
        what = (
            "a plain pickle, not written by torch.save"
            if kind is FileKind.PICKLE
            else "not a file written by torch.save"
        )
        raise NotACheckpointError(f"{str(p)!r} is {what}; point to a .pt/.pth file saved with torch.save")
    return p


def check_walkable(obj: _T, subject: str) -> _T:
    """``obj`` as it is, or :class:`NotACheckpointError` when it holds a container that contains itself
    or nests deeper than any state dict: every reader calls this on what it unpickled, so no walker
    (detection, device moves, the CLI's summaries) meets a pickle built to overflow the stack."""
    from .._core.tree import structure_problem  # torch's: imported where a reader has unpickled something

    problem = structure_problem(obj)
    if problem is not None:
        raise NotACheckpointError(
            f"{subject} is not what torch.save writes from state dicts: {problem}; "
            "re-save it from the objects' state_dict() calls"
        )
    return obj


def unsafe_error(path: Location | str, err: BaseException) -> UnsafeCheckpointError:
    """The one refusal message: what ``torch.load(weights_only=True)`` refused in ``path``, and what to do.

    Used by the torch-file loader, the archive reader and DCP's entry reader alike; ``path`` is a
    file or the words naming what was read (``"DCP entry 'extra' of 'ckpt'"``).
    """
    from .._core.torch_compat.wording import refused_global  # torch's wording: imported where torch refused something

    refused = refused_global(err)
    never = "do not load it unless you made it yourself (then, and only then, pass weights_only=False)"
    if refused.blocked_module:
        what = (
            f"it calls {refused.name}, from the module {refused.blocked_module} that "
            "torch.load(weights_only=True) blocks entirely: loading it would run code"
        )
        fix = never
    elif refused.name and refused.is_builtin:  # exec, eval, ...: never something to allow
        what = (
            f"it calls the builtin {refused.name.strip('.')}, which torch.load(weights_only=True) refuses and "
            "no checkpoint needs: loading it would run code"
        )
        fix = never
    elif refused.name:
        module, _, attr = refused.name.rpartition(".")
        what = f"it references {refused.name}, which torch.load(weights_only=True) refuses"
        fix = (
            f"if you trust the file, allow it with `from {module} import {attr}; "
            f"torch.serialization.add_safe_globals([{attr}])`, or pass weights_only=False"
        )
    else:
        what = "torch.load(weights_only=True) refuses an object in it"
        fix = "if you trust the file, pass weights_only=False; never do so for a file from an unknown source"
    subject = path if isinstance(path, str) else f"checkpoint {str(path)!r}"
    return UnsafeCheckpointError(f"{subject} cannot be loaded safely: {what}; {fix}")
