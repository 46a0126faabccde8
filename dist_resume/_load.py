"""Reading checkpoint files: placement per local rank, and errors that say what is wrong with the file."""

from __future__ import annotations

import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeAlias

import torch

from ._env import rank_device
from ._errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    UnsafeCheckpointError,
)

__all__ = ["MapLocation", "PathLike", "rank_map_location", "load_checkpoint", "check_file", "file_kind"]

PathLike: TypeAlias = str | os.PathLike[str]
MapLocation: TypeAlias = (
    str | int | torch.device | dict[str, str] | Callable[[torch.UntypedStorage, str], Any] | None
)

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
# weights_only unpickler messages that mean damaged bytes, not a refused object
_GARBLED_PICKLE = ("Unsupported operand", "String is too long", "Expected bytes, got")


def rank_map_location(device: torch.device | str | int | None = None) -> torch.device:
    """A ``map_location`` that puts **every** storage on ``device`` (default :func:`rank_device`).

    Local. Whatever tags the file carries (``cuda:0`` from rank 0, ``cuda:3``, ``cpu``), everything
    lands on this rank's device: a dict such as ``{"cuda:0": "cuda:1"}`` would leave ``cuda:3``
    and ``cpu`` where they were, and no map_location at all piles every rank onto cuda:0.

    Example::

        >>> sd = torch.load(path, map_location=dist_resume.rank_map_location(), weights_only=True)
        >>> dist_resume.rank_map_location("cpu")
        device(type='cpu')
    """
    if device is None:
        return rank_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


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


def _corrupt(path: Path, err: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} is damaged or truncated ({_first_line(err)}); "
        "most likely a save that was interrupted: resume from an earlier checkpoint"
    )


def _first_line(err: BaseException) -> str:
    lines = str(err).splitlines() or [""]
    detail = [line for line in lines if any(m in line for m in _GARBLED_PICKLE)]
    text = (detail or lines)[0].split(". This is an internal")[0]
    return f"{type(err).__name__}: {text[:200]}"


def _unsafe(path: Path, err: BaseException) -> UnsafeCheckpointError:
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    name = found.group(1) if found else None
    if blocked:
        what = (f"it calls {blocked.group(1)}, from the module {blocked.group(2).rstrip('.')} that "
                "torch.load(weights_only=True) blocks entirely: loading it would run code")
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


def load_checkpoint(
    path: PathLike,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
) -> Any:
    """``torch.load`` with rank-aware placement and errors that name the file and the fix.

    Local: every rank may call it; each one loads onto its own device. ``map_location`` defaults
    to :func:`rank_map_location` (``cuda:<LOCAL_RANK>``, or ``cpu`` without CUDA). ``mmap=True``
    maps the file instead of reading it into memory. Missing, empty, truncated, corrupt, foreign
    and unsafe files raise a :class:`CheckpointError` subclass, never a bare ``EOFError`` or
    ``UnpicklingError``. ``verify=True`` first checks the CRC-32 of every record (``torch.load``
    never does; reads the file once more) and raises :class:`CheckpointCorruptError` on a mismatch.

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> dist_resume.load_checkpoint("ckpt.pt", map_location="cpu")["w"]
        tensor([1., 1.])
    """
    p = check_file(path)
    if verify:  # refuses the legacy format, which has no checksums
        from ._archive import verify_archive  # _archive imports this module

        verify_archive(p)
    if file_kind(p) == "legacy" and mmap:
        raise NotACheckpointError(
            f"checkpoint {str(p)!r} uses torch's legacy (pre-1.6) format, which cannot be memory-mapped; "
            "pass mmap=False, or re-save it once: torch.save(torch.load(path, weights_only=True), new_path)"
        )
    if map_location is None or isinstance(map_location, int):
        map_location = rank_map_location(map_location)
    try:
        return torch.load(p, map_location=map_location, mmap=mmap, weights_only=weights_only)  # type: ignore[arg-type]
    except pickle.UnpicklingError as err:
        text = str(err)
        if "Weights only load failed" in text and not any(m in text for m in _GARBLED_PICKLE):
            raise _unsafe(p, err) from err
        raise _corrupt(p, err) from err
    except (EOFError, zipfile.BadZipFile, ValueError) as err:
        raise _corrupt(p, err) from err
    except RuntimeError as err:
        text = str(err)
        if "on a CUDA device but torch.cuda.is_available() is False" in text or "invalid device ordinal" in text:
            if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type == "cuda":
                raise CheckpointError(
                    f"cannot load checkpoint {str(p)!r} onto map_location={map_location!r}: this process has "
                    f"{torch.cuda.device_count()} visible CUDA device(s); use dist_resume.rank_map_location()"
                ) from err
            raise CheckpointError(
                f"checkpoint {str(p)!r} was saved from a GPU and map_location={map_location!r} does not move "
                "every storage to a device this process has; use dist_resume.rank_map_location()"
            ) from err
        if 'hasRecord("version")' in text or "failed locating file data.pkl" in text:
            raise NotACheckpointError(
                f"{str(p)!r} is a zip archive but not one written by torch.save (it has no data.pkl/version "
                "record); point to a .pt/.pth file saved with torch.save"
            ) from err
        if "PytorchStreamReader" in text or "zip archive" in text or "storage" in text.lower():
            raise _corrupt(p, err) from err
        raise
    except OSError as err:
        if isinstance(err, (PermissionError, FileNotFoundError)):
            raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {err.strerror or err}") from err
        raise _corrupt(p, err) from err  # e.g. EINVAL from mapping a truncated archive
