"""Reading checkpoint files: placement per local rank, and errors that say what is wrong with the file."""

from __future__ import annotations

import contextlib
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

import torch

from .._core.errors import (
    CheckpointCorruptError,
    CheckpointError,
    EnvironmentMismatchError,
    NotACheckpointError,
)
from .._core.location import Location, RemotePath
from .._core.security import warn_if_unsafe_torch
from .._core.torch_compat.private import allowing_plain_globals
from .._core.torch_compat.wording import (
    LoadFailure,
    classify_load_error,
    error_summary,
    is_damaged_pickle_error,
    is_out_of_memory,
)
from .._core.types import MapLocation
from .._dist.accelerator import current_accelerator
from .._dist.env import rank_device
from .._sim import sim_tags_note
from .._store.ranges import RangeFile
from .safe_open import vanished
from .small_records import read_checked_records
from .sniff import FileKind, check_file, check_walkable, file_kind, unsafe_error
from .zip_verify import verify_zip

__all__ = ["rank_map_location", "load_torch_file"]


def rank_map_location(device: torch.device | str | int | None = None) -> torch.device:
    """A ``map_location`` that puts **every** storage on ``device`` (default :func:`rank_device`).

    Local. Whatever tags the file carries (``cuda:0`` from rank 0, ``cuda:3``, ``npu:0``, ``xpu:1``,
    ``cpu``, a PrivateUse1 backend's own name), everything lands on this rank's device, so a file
    written on one accelerator resumes on another: a dict such as ``{"cuda:0": "cuda:1"}`` would leave
    ``cuda:3`` and ``cpu`` where they were, and no map_location at all piles every rank onto device 0.
    An ``int`` is an index of this process's accelerator (``torch.device(i)`` does the same).

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> sd = torch.load("ckpt.pt", map_location=dist_resume.rank_map_location(), weights_only=True)
        >>> dist_resume.rank_map_location("cpu")
        device(type='cpu')
    """
    if device is None:
        return rank_device()
    if isinstance(device, int):
        acc = current_accelerator()
        if acc is None:
            raise EnvironmentMismatchError(
                f"map_location={device} names device {device} of this process's accelerator, but it has none "
                "(a CPU-only host); pass 'cpu', a device such as 'cuda:1', or None for this rank's device"
            )
        return torch.device(acc.type, device)
    return torch.device(device)


def _visible(device_type: str) -> str:
    """``"2 visible cuda device(s) (CUDA_VISIBLE_DEVICES=0,1)"``, or ``"0 visible xpu device(s)"``."""
    acc = current_accelerator()
    if acc is not None and acc.type == device_type:
        return acc.describe()
    return f"0 visible {device_type} device(s)" + (f" (its accelerator is {acc.type})" if acc else "")


def _corrupt(path: Location, err: BaseException) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint {str(path)!r} is damaged or truncated ({error_summary(err)}); "
        "most likely a save that was interrupted: resume from an earlier checkpoint"
    )


@contextlib.contextmanager
def _opened(p: Location) -> Iterator[Path | IO[bytes]]:
    """What torch.load reads: a local path (which it may map), or an object read by ranges."""
    if not isinstance(p, RemotePath):
        yield p
        return
    with RangeFile(p) as f:
        yield cast(IO[bytes], f)


def load_torch_file(
    path: Location,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
    verify: bool = False,
) -> Any:
    """``torch.load`` of one torch file with rank-aware placement and errors that name the file and the fix.

    Local: every rank may call it; each one loads onto its own device. ``map_location`` defaults
    to :func:`rank_map_location` (``<accelerator>:<LOCAL_RANK>``, or ``cpu`` without one). ``mmap=True``
    maps the file instead of reading it into memory. Missing, empty, truncated, corrupt, foreign
    and unsafe files raise a :class:`CheckpointError` subclass, never a bare ``EOFError`` or
    ``UnpicklingError``. The CRC-32 of every small record (``data.pkl``, ``version``, ...: all but
    the tensor data) is checked first, always (``torch.load`` never does); ``verify=True`` checks
    every record's, tensor data included (reads the file once more). A mismatch raises
    :class:`CheckpointCorruptError` before anything is unpickled.

    An object on a store (a URL) is read by ranges into memory (``mmap`` does not apply: nothing local to map).

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> load_torch_file(Path("ckpt.pt"), map_location="cpu")["w"]
        tensor([1., 1.])
    """
    p = check_file(path)
    if verify:  # refuses the legacy format, which has no checksums
        verify_zip(p)
    legacy = file_kind(p) is FileKind.LEGACY
    remote = isinstance(p, RemotePath)
    mmap = mmap and not remote
    if legacy and mmap:
        raise NotACheckpointError(
            f"checkpoint {str(p)!r} uses torch's legacy (pre-1.6) format, which cannot be memory-mapped; "
            "pass mmap=False, or re-save it once: torch.save(torch.load(path, weights_only=True), new_path)"
        )
    if not legacy and not verify:
        # torch's C++ zip reader trusts the directory's offsets and sizes (a size field set to 0xFFFFFFFF
        # makes it allocate 4 GiB for a tiny file) and no CRC: check those and every small record's CRC
        read_checked_records(p)
    warn_if_unsafe_torch()
    if map_location is None or isinstance(map_location, int):
        map_location = rank_map_location(map_location)
    try:
        with allowing_plain_globals(), _opened(p) as source:  # argparse.Namespace (``args``) carries no code
            obj = torch.load(source, map_location=map_location, mmap=mmap, weights_only=weights_only)  # type: ignore[arg-type]
    except pickle.UnpicklingError as err:
        if classify_load_error(err) is LoadFailure.UNSAFE:
            raise unsafe_error(p, err) from err
        raise _corrupt(p, err) from err
    except (EOFError, zipfile.BadZipFile, ValueError) as err:
        raise _corrupt(p, err) from err
    except (KeyError, IndexError, TypeError, AttributeError, OverflowError, AssertionError, struct.error) as err:
        # a damaged data.pkl makes torch's tensor rebuilding fail with arbitrary errors; only those
        # raised inside torch count as damage (a map_location callable's own bug propagates)
        if not is_damaged_pickle_error(err):
            raise
        raise _corrupt(p, err) from err
    except RuntimeError as err:
        failure = classify_load_error(err)
        if failure is LoadFailure.NO_DEVICE:
            if isinstance(map_location, (str, torch.device)) and torch.device(map_location).type != "cpu":
                raise CheckpointError(
                    f"cannot load checkpoint {str(p)!r} onto map_location={map_location!r}: this process has "
                    f"{_visible(torch.device(map_location).type)}; use dist_resume.rank_map_location()"
                ) from err
            sim = sim_tags_note(re.findall(r"\bsim:\d+", str(err)) + (["sim"] if "SIM device" in str(err) else []))
            raise CheckpointError(
                f"checkpoint {str(p)!r} was saved on an accelerator and map_location={map_location!r} does not "
                "move every storage to a device this process has; use dist_resume.rank_map_location()"
                + (f"; {sim}" if sim else "")
            ) from err
        if failure is LoadFailure.NOT_TORCH_ARCHIVE:
            raise NotACheckpointError(
                f"{str(p)!r} is a zip archive but not one written by torch.save (it has no data.pkl/version "
                "record); point to a .pt/.pth file saved with torch.save"
            ) from err
        if failure is LoadFailure.DAMAGED:
            raise _corrupt(p, err) from err
        if is_damaged_pickle_error(err) and not is_out_of_memory(err):  # e.g. "requires_grad must be a bool"
            raise _corrupt(p, err) from err
        raise
    except OSError as err:
        if isinstance(err, FileNotFoundError):  # there when check_file looked: a writer's rotation removed it
            raise vanished(p, err) from err
        if isinstance(err, PermissionError):
            raise CheckpointError(f"cannot read checkpoint {str(p)!r}: {err.strerror or err}") from err
        raise _corrupt(p, err) from err  # e.g. EINVAL from mapping a truncated archive
    return check_walkable(obj, f"checkpoint {str(p)!r}")
