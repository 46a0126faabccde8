"""The manifest of a sharded checkpoint folder: every file with its size and CRC-32, and what the folder holds.

A sharded checkpoint (what an FSDP2 run saves by default) is one folder: torch's DCP files (``.metadata``
and each writing rank's ``__<rank>_<n>.distcp``), ``train_state.pt`` (the non-tensor state: scheduler,
scaler, step, per-rank RNG, sampler position, metadata) and, written last, ``manifest.json``. The folder
counts as a checkpoint only when its manifest parses and every file it lists is there with its size
(and, checked with ``verify``, its CRC-32). The manifest is JSON so that tools without torch can read it.

Torch-free: this module imports nothing but the standard library and the error classes.
"""

from __future__ import annotations

import json
import os
import re
import stat
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointCorruptError, NotACheckpointError

__all__ = [
    "SHARDED_FORMAT",
    "SHARDED_VERSION",
    "MANIFEST",
    "TRAIN_STATE",
    "DCP_METADATA",
    "SHARD_FILE",
    "FileEntry",
    "FileProblem",
    "Manifest",
    "file_crc32",
    "file_entry",
    "read_manifest",
    "manifest_problems",
]

SHARDED_FORMAT: Final = "dist_resume.sharded"
SHARDED_VERSION: Final = 1
MANIFEST: Final = "manifest.json"
TRAIN_STATE: Final = "train_state.pt"
DCP_METADATA: Final = ".metadata"
SHARD_FILE: Final = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<n>.distcp
_CHUNK: Final = 4 << 20
_MAX_MANIFEST: Final = 64 << 20  # a manifest lists files: megabytes at most even for thousands of ranks


def file_crc32(path: str | os.PathLike[str]) -> int:
    """The CRC-32 (zlib's) of a whole file, read in 4 MiB chunks. Local."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One file of a sharded checkpoint: its name in the folder, size in bytes, CRC-32, and the rank that wrote it."""

    name: str
    size: int
    crc32: int
    rank: int

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "crc32": f"{self.crc32:08x}", "rank": self.rank}


def file_entry(path: Path, rank: int) -> FileEntry:
    """Describe the file at ``path`` (written by ``rank``), reading it once for its CRC-32. Local."""
    return FileEntry(path.name, path.stat().st_size, file_crc32(path), rank)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What ``manifest.json`` records (see docs/checkpoint-folders.md for the schema)."""

    step: int | None
    epoch: int | None
    world_size: int  # the saving run's world size (one RNG entry per rank)
    mesh_shape: tuple[int, ...] | None  # the model's device mesh; None: written from full tensors (convert)
    mesh_dim_names: tuple[str, ...] | None
    writers: int  # how many ranks wrote DCP files
    contents: tuple[str, ...]  # the top-level entries of the DCP state: "model", "optimizer", "ema"
    files: tuple[FileEntry, ...]
    save_id: str
    saved_at: float
    torch_version: str
    dist_resume_version: str

    @property
    def size(self) -> int:
        """The bytes of every file the manifest lists (the manifest itself not counted)."""
        return sum(f.size for f in self.files)

    def to_json(self) -> bytes:
        body = {
            "format": SHARDED_FORMAT,
            "format_version": SHARDED_VERSION,
            "step": self.step,
            "epoch": self.epoch,
            "world_size": self.world_size,
            "mesh_shape": None if self.mesh_shape is None else list(self.mesh_shape),
            "mesh_dim_names": None if self.mesh_dim_names is None else list(self.mesh_dim_names),
            "writers": self.writers,
            "contents": list(self.contents),
            "save_id": self.save_id,
            "saved_at": self.saved_at,
            "torch_version": self.torch_version,
            "dist_resume_version": self.dist_resume_version,
            "files": [f.as_json() for f in self.files],
        }
        return (json.dumps(body, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        """Parse and check a manifest; :class:`CheckpointCorruptError` naming ``where`` for anything off."""
        try:
            body = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError) as err:
            raise _damaged(where, f"it is not JSON ({err})") from err
        if not isinstance(body, dict) or body.get("format") != SHARDED_FORMAT:
            raise _damaged(where, f"it has no format {SHARDED_FORMAT!r}")
        if body.get("format_version") != SHARDED_VERSION:
            raise NotACheckpointError(
                f"{where} is format version {body.get('format_version')!r}; this dist_resume reads version "
                f"{SHARDED_VERSION}: upgrade dist_resume"
            )
        try:
            files = tuple(_entry(f) for f in body["files"])
            names = [f.name for f in files]
            if len(set(names)) != len(names) or MANIFEST in names:
                raise ValueError("a file is listed twice, or the manifest lists itself")
            shape, dims = body["mesh_shape"], body["mesh_dim_names"]
            manifest = cls(
                _opt_int(body["step"]),
                _opt_int(body["epoch"]),
                _int(body["world_size"]),
                None if shape is None else tuple(_int(n) for n in shape),
                None if dims is None else tuple(_str(n) for n in dims),
                _int(body["writers"]),
                tuple(_str(c) for c in body["contents"]),
                files,
                _str(body["save_id"]),
                float(body["saved_at"]),
                _str(body["torch_version"]),
                _str(body["dist_resume_version"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise _damaged(where, f"{type(err).__name__}: {err}") from err
        return manifest


def _damaged(where: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where} is damaged ({what}); the folder does not count as a checkpoint: resume from an earlier one"
    )


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"{value!r} is not a non-negative int")
    return value


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a str")
    return value


def _entry(value: Any) -> FileEntry:
    name = _str(value["name"])
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise ValueError(f"file name {name!r} is not a name inside the folder")
    crc = _str(value["crc32"])
    if not re.fullmatch(r"[0-9a-f]{8}", crc):
        raise ValueError(f"crc32 {crc!r} is not 8 hex digits")
    return FileEntry(name, _int(value["size"]), int(crc, 16), _int(value["rank"]))


def read_manifest(folder: str | os.PathLike[str]) -> tuple[Manifest, bytes]:
    """The folder's :class:`Manifest` and the manifest's bytes (what a digest covers). Local; reads one small file.

    A folder without ``manifest.json`` raises :class:`NotACheckpointError` (its save never finished, or it
    was copied in part); one whose manifest does not parse :class:`CheckpointCorruptError`.
    """
    path = Path(folder) / MANIFEST
    where = f"checkpoint {str(Path(folder))!r}"
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_MANIFEST + 1)
    except FileNotFoundError as err:
        raise NotACheckpointError(
            f"{where} has no {MANIFEST}: its save did not finish (a killed save is never renamed to this name, "
            "so the folder was copied or edited in part); it does not count as a checkpoint: resume from an "
            "earlier one, or copy the whole folder again"
        ) from err
    except OSError as err:
        raise CheckpointCorruptError(f"cannot read {str(path)!r}: {err.strerror or err}") from err
    if len(data) > _MAX_MANIFEST:
        raise _damaged(f"{where}: {MANIFEST}", f"larger than {_MAX_MANIFEST} bytes")
    return Manifest.from_json(data, f"{where}: {MANIFEST}"), data


@dataclass(frozen=True, slots=True)
class FileProblem:
    """A file of the folder that differs from the manifest: missing, another size, or (``crc``) another CRC-32."""

    name: str
    problem: str
    crc: bool = False


def manifest_problems(folder: str | os.PathLike[str], manifest: Manifest, *, verify: bool) -> list[FileProblem]:
    """How the folder's files differ from ``manifest``: each listed file must be a regular file of the listed size,
    and with ``verify`` have the listed CRC-32 (reads every file once). Local. Files the manifest does not list
    are no part of the checkpoint and are not looked at."""
    root = Path(folder)
    problems = []
    for entry in manifest.files:
        path = root / entry.name
        try:
            st = path.stat()
        except FileNotFoundError:
            problems.append(FileProblem(entry.name, "is missing"))
            continue
        except OSError as err:
            problems.append(FileProblem(entry.name, f"cannot be read ({err.strerror or err})"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append(FileProblem(entry.name, "is not a regular file"))
        elif st.st_size != entry.size:
            problems.append(FileProblem(entry.name, f"holds {st.st_size} bytes, the manifest says {entry.size}"))
        elif verify:
            try:
                crc = file_crc32(path)
            except OSError as err:
                problems.append(FileProblem(entry.name, f"cannot be read ({err.strerror or err})"))
                continue
            if crc != entry.crc32:
                problems.append(
                    FileProblem(entry.name, f"CRC-32 {crc:08x}, the manifest says {entry.crc32:08x}", crc=True)
                )
    return problems
