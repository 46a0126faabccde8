"""What ``dist-resume check`` sees of a checkpoint folder while a run writes it: which checkpoints are complete, and
which are new. Torch-free: the folder is looked at every few hundredths of a second while the command runs.

A checkpoint here is an entry of the folder that a save wrote: a file with a checkpoint suffix (``ckpt_<step>.pt``,
``snapshot.pt``, ``model.safetensors``, ...) or a folder with a number in its name (``ckpt_<step>.dcp/``, an HF
Trainer ``checkpoint-N/``; not ``runs/``).
Its *version* is what a rewrite changes (modification time and size; for a folder, of its files), so a snapshot
saved again under the same name is a new checkpoint. It counts once *complete*: a ``CheckpointManager`` name appears
only through a rename after the data is durable; a zip archive (``torch.save``'s format) once its end record is
written; anything else once its version stayed the same for :data:`SETTLE_S`. Names starting with ``.`` (temporary
files of atomic saves) and ``tmp`` are never checkpoints.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from .._fast import CHECKPOINT_NAME

__all__ = ["SETTLE_S", "SUFFIXES", "Entry", "FolderWatch", "step_of", "complete_versions"]

SETTLE_S: Final = 0.2  # seconds an entry's version must stay the same to count as complete (when nothing else says)
SUFFIXES: Final = (".pt", ".pth", ".ckpt", ".bin", ".safetensors", ".tar", ".distcp")
_ZIP_END: Final = b"PK\x05\x06"  # the end-of-central-directory record: torch.save writes it last
_LAST_NUMBER: Final = re.compile(r"(\d+)(?!.*\d)")


def step_of(name: str) -> int | None:
    """The step a checkpoint's name gives: ``ckpt_00000012.pt`` -> 12, ``checkpoint-500`` -> 500, ``epoch_3.pt`` ->
    3, ``snapshot.pt`` -> None."""
    own = CHECKPOINT_NAME.match(name)
    if own:
        return int(own.group(1))
    stem = name.split(".", 1)[0]
    found = _LAST_NUMBER.search(stem)
    return int(found.group(1)) if found else None


@dataclass(frozen=True)
class Entry:
    """One checkpoint of a folder as last seen: ``name`` in the folder, ``step`` from the name (or None), ``version``
    (what a rewrite changes) and whether it is ``complete``."""

    name: str
    step: int | None
    version: tuple[int, int, int]
    complete: bool


def _version(path: Path, is_dir: bool) -> tuple[int, int, int]:
    """(latest modification in ns, bytes, files) of a file or of a folder's files (one level down, and its own)."""
    if not is_dir:
        st = path.stat()
        return st.st_mtime_ns, st.st_size, 1
    newest, size, count = path.stat().st_mtime_ns, 0, 0
    for sub in os.scandir(path):
        if sub.is_file(follow_symlinks=False):
            st = sub.stat(follow_symlinks=False)
            newest, size, count = max(newest, st.st_mtime_ns), size + st.st_size, count + 1
    return newest, size, count


def _zip_complete(path: Path, size: int) -> bool | None:
    """Whether a zip archive's end record is in place (None: not a zip, so this cannot tell)."""
    try:
        with open(path, "rb") as f:
            if f.read(2) != b"PK":
                return None
            f.seek(max(0, size - 22))  # torch writes no archive comment: the record is the last 22 bytes
            return f.read(4) == _ZIP_END
    except OSError:
        return False


@dataclass
class FolderWatch:
    """Looks at ``folder`` again on each :meth:`look`: the checkpoints in it, complete or not, and when each version
    was first seen complete. Local."""

    folder: Path
    _first_seen: dict[tuple[str, tuple[int, int, int]], float] = field(default_factory=dict)
    _pending: dict[tuple[str, tuple[int, int, int]], float] = field(default_factory=dict)

    def look(self, now: float) -> list[Entry]:
        """The folder's checkpoints now (``now``: a ``time.monotonic()``), complete or not, sorted by step then name."""
        found = []
        try:
            listing = list(os.scandir(self.folder))
        except OSError:  # not created yet, or removed
            return []
        for item in listing:
            name = item.name
            if name.startswith((".", "tmp")):
                continue
            try:
                is_dir = item.is_dir(follow_symlinks=False)
                if not (name.endswith(SUFFIXES) if not is_dir else step_of(name) is not None):
                    continue  # a log folder (runs/), a config file, ...
                version = _version(Path(item.path), is_dir)
            except OSError:  # replaced or removed while looked at
                continue
            found.append(Entry(name, step_of(name), version, self._complete(item.path, name, is_dir, version, now)))
        return sorted(found, key=lambda e: (e.step if e.step is not None else -1, e.name))

    def _complete(self, path: str, name: str, is_dir: bool, version: tuple[int, int, int], now: float) -> bool:
        key = (name, version)
        if key in self._first_seen:
            return True
        done: bool | None = None
        if CHECKPOINT_NAME.match(name):
            done = True  # renamed into place once durable
        elif not is_dir:
            done = _zip_complete(Path(path), version[1])
        if done is None:  # settled: the same version for SETTLE_S
            since = self._pending.setdefault(key, now)
            done = now >= since + SETTLE_S  # not now - since: (t + 0.2) - t may come out below 0.2
        if done:
            self._first_seen[key] = now
        return done

    def first_seen(self, entry: Entry) -> float | None:
        """When ``entry``'s version was first seen complete (a ``time.monotonic()``), or None."""
        return self._first_seen.get((entry.name, entry.version))


def complete_versions(entries: list[Entry]) -> set[tuple[str, tuple[int, int, int]]]:
    """The (name, version) of every complete entry: what a later look compares with to find new checkpoints."""
    return {(e.name, e.version) for e in entries if e.complete}
