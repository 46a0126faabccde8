"""What a path holds before torch reads it: the file's kind by its first bytes, and refusals worded once."""

from __future__ import annotations

import re
from pathlib import Path

from .._core.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsafeCheckpointError,
)
from .._core.types import PathLike

__all__ = ["GARBLED_PICKLE", "file_kind", "check_file", "unsafe_error"]

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
# weights_only unpickler messages that mean damaged bytes, not a refused object
GARBLED_PICKLE = ("Unsupported operand", "String is too long", "Expected bytes, got")


def file_kind(path: Path) -> str:
    """``zip`` (torch >= 1.6), ``legacy`` (older torch.save), ``pickle``, ``empty`` or ``unknown``."""
    with open(path, "rb") as f:
        head = f.read(16)
    if not head:
        return "empty"
    if head.startswith(_ZIP_MAGIC):
        return "zip"
    if head[:1] == b"\x80" and _LEGACY_MAGIC in head:
        return "legacy"
    if head[:1] == b"\x80":
        return "pickle"
    return "unknown"


def check_file(path: PathLike) -> Path:
    """Raise the right :class:`CheckpointError` when ``path`` cannot be a checkpoint; return it as a Path."""
    p = Path(path)
    if not p.exists():
        hint = f" (the folder {str(p.parent)!r} does not exist either)" if not p.parent.exists() else ""
        raise CheckpointNotFoundError(f"checkpoint {str(p)!r} does not exist{hint}; check the path")
    if p.is_dir():
        raise CheckpointNotFoundError(
            f"checkpoint {str(p)!r} is a folder, not a file; pass a file inside it "
            "(or a checkpoint folder to resume(), which picks the newest valid checkpoint)"
        )
    try:
        kind = file_kind(p)
    except OSError as err:
        raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {err.strerror or err}; check permissions") from err
    if kind == "empty":
        raise CheckpointCorruptError(
            f"checkpoint {str(p)!r} is empty (0 bytes), most likely a save that was interrupted; "
            "resume from an earlier checkpoint and delete this one"
        )
    if kind in ("unknown", "pickle"):
        what = "a plain pickle, not written by torch.save" if kind == "pickle" else "not a file written by torch.save"
        raise NotACheckpointError(f"{str(p)!r} is {what}; point to a .pt/.pth file saved with torch.save")
    return p


def unsafe_error(path: Path, err: BaseException) -> UnsafeCheckpointError:
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    name = found.group(1) if found else None
    if blocked:
        what = (
            f"it calls {blocked.group(1)}, from the module {blocked.group(2).rstrip('.')} that "
            "torch.load(weights_only=True) blocks entirely: loading it would run code"
        )
        fix = "do not load it unless you made it yourself (then, and only then, pass weights_only=False)"
    elif name and "." not in name.strip("."):  # a builtin such as exec or eval: never something to allow
        what = f"it calls the builtin {name.strip('.')}, which torch.load(weights_only=True) refuses: loading it would run code"
        fix = "do not load it unless you made it yourself (then, and only then, pass weights_only=False)"
    elif name:
        module, _, attr = name.rpartition(".")
        what = f"it references {name}, which torch.load(weights_only=True) refuses"
        fix = (
            f"if you trust the file, allow it with `from {module} import {attr}; "
            f"torch.serialization.add_safe_globals([{attr}])`, or pass weights_only=False"
        )
    else:
        what = "torch.load(weights_only=True) refuses an object in it"
        fix = "if you trust the file, pass weights_only=False; never do so for a file from an unknown source"
    return UnsafeCheckpointError(f"checkpoint {str(path)!r} cannot be loaded safely: {what}; {fix}")
