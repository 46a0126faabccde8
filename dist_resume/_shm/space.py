"""How much shared memory a snapshot needs and has, and what a folder's snapshots hold. Torch-free.

``/dev/shm`` is a tmpfs the host sizes (FACTS 40): half the RAM by default, but 64 MiB in a Docker container without
``--shm-size``, and in a Kubernetes pod only what an ``emptyDir`` with ``medium: Memory`` gives. A write past it fails
with ``ENOSPC``; the check before a write and the error after one say the same thing and the same fix.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Final

from .._core.errors import CheckpointWriteError
from .._core.location import Location
from .place import SHM_DIR_ENV, owned_store, store_dir
from .record import ENTRY

__all__ = ["NO_SPACE", "size_estimate", "free_bytes", "check_space", "no_space_error", "held_bytes"]

NO_SPACE: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The ``errno`` values of a full shared memory (a tmpfs's size, or a quota)."""

_PER_TENSOR: Final = 512  # a zip record's local header, central directory entry, 64-byte alignment and pickle
_FIXED: Final = 64 * 1024  # the pickle of the structure, the zip's own records


def size_estimate(tensor_bytes: int, tensors: int) -> int:
    """A torch file's size, at most, for ``tensors`` storages holding ``tensor_bytes`` bytes in all (for
    ``size_hint``); a structure with many small Python objects needs its pickle's size added. Local."""
    return tensor_bytes + tensors * _PER_TENSOR + _FIXED


def free_bytes(store: Path) -> int:
    """The bytes this user may still write into ``store``'s filesystem (``os.statvfs``). Local."""
    st = os.statvfs(store)
    return st.f_bavail * st.f_frsize


def _shown(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def no_space_error(store: Path, step: int, need: int, free: int | None) -> CheckpointWriteError:
    """The error of a snapshot that does not fit: what it needs, what is free, and the fixes."""
    has = "" if free is None else f", and {_shown(free)} is free there (the slot it replaces included)"
    return CheckpointWriteError(
        f"the snapshot of step {step} needs {_shown(need)} of shared memory in {str(store.parent)!r}{has}; "
        "the previous snapshot is untouched. Shared memory is a tmpfs the host sizes: give the container more "
        "(Docker: `--shm-size=16g`, its default is 64 MiB; Kubernetes: an emptyDir volume with `medium: Memory` "
        f"mounted at /dev/shm, with a sizeLimit), set {SHM_DIR_ENV} to a larger tmpfs, or snapshot less state"
    )


def check_space(store: Path, step: int, need: int, reclaimed: int) -> None:
    """Raise :func:`no_space_error` unless ``need`` bytes fit in ``store``, counting the ``reclaimed`` bytes of the
    slot file the write replaces. Local; changes nothing."""
    free = free_bytes(store) + reclaimed
    if free < need:
        raise no_space_error(store, step, need, free)


def held_bytes(folder: Location) -> int:
    """The bytes of shared memory ``folder``'s snapshots hold on this node (every part, both slots, and the
    partial file of a write in progress or killed). Local; 0 without any."""
    store = store_dir(folder)
    if store is None or not owned_store(store):
        return 0
    total = 0
    for entry in os.scandir(store):
        if ENTRY.match(entry.name) is None:
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == os.getuid():
            total += st.st_size
    return total
