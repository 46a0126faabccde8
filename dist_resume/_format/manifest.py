"""The manifest of a sharded checkpoint folder: every file with its size and CRC-32, and what the folder holds.

A sharded checkpoint (what an FSDP2 run saves by default) is one folder: torch's DCP files (``.metadata``
and each writing rank's ``__<rank>_<n>.distcp``), ``train_state.pt`` (the non-tensor state: scheduler,
scaler, step, per-rank RNG, sampler position, metadata) and, written last, ``manifest.json``. The folder
counts as a checkpoint only when its manifest parses, every file it lists is there with its size (and, checked with
``verify``, its CRC-32), it holds no other file, and ``.metadata`` describes what the listed shards hold
(:mod:`.sharded_files` checks the folder against its manifest). The manifest is JSON so that tools without torch can
read it.

Torch-free: this module imports nothing but the standard library, the error classes, the wording of values
(:mod:`.._core.text`), the torch-free path types and store layer, and the modules beside it.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .._core.bounds import count_problem, time_problem
from .._core.errors import CheckpointCorruptError, CheckpointNotFoundError, NotACheckpointError
from .._core.location import Location
from .._core.text import described
from .._core.untrusted import untrusted
from .safe_open import check_name, open_in_folder, read_in_folder

__all__ = [
    "SHARDED_FORMAT",
    "SHARDED_VERSION",
    "MANIFEST",
    "TRAIN_STATE",
    "DCP_METADATA",
    "SHARD_FILE",
    "REQUIRED",
    "FileEntry",
    "Manifest",
    "file_crc32",
    "file_entry",
    "read_manifest",
]

SHARDED_FORMAT: Final = "dist_resume.sharded"
SHARDED_VERSION: Final = 1
MANIFEST: Final = "manifest.json"
TRAIN_STATE: Final = "train_state.pt"
DCP_METADATA: Final = ".metadata"
SHARD_FILE: Final = re.compile(r"^__(?P<rank>\d+)_\d+\.distcp$")  # DCP's FileSystemWriter: __<rank>_<n>.distcp
_CHUNK: Final = 4 << 20
_MAX_MANIFEST: Final = 64 << 20  # a manifest lists files: megabytes at most even for thousands of ranks
_MAX_TEXT: Final = 4096  # a save id, a version, a mesh dimension's name
_MAX_ITEMS: Final = 1 << 20  # files in one folder, dimensions of a mesh, entries of the DCP state
REQUIRED: Final = (".metadata", "train_state.pt")  # every sharded folder holds these (and its shards)


def file_crc32(path: Location) -> int:
    """The CRC-32 (zlib's) of a whole file, read in 4 MiB chunks; a link or special file is refused (as
    :func:`~dist_resume._format.safe_open.open_in_folder` refuses it). Local."""
    crc = 0
    p = path
    with open_in_folder(p.parent, p.name) as f:
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
        """Parse and check a manifest; :class:`CheckpointCorruptError` naming ``where`` for anything off: not UTF-8
        JSON, nested past Python's limit, NaN or infinity, a field missing or of another type, an integer outside
        int64, a file name that is not a name inside the folder."""
        try:
            body = json.loads(data.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as err:
            raise _damaged(where, f"it is not JSON ({type(err).__name__}: {str(err)[:200]})") from err
        if not isinstance(body, dict) or body.get("format") != SHARDED_FORMAT:
            raise _damaged(where, f"it has no format {SHARDED_FORMAT!r}")
        if body.get("format_version") != SHARDED_VERSION:
            raise NotACheckpointError(
                f"{where} is format version {described(body.get('format_version'), 40)}; this dist_resume reads version "
                f"{SHARDED_VERSION}: upgrade dist_resume"
            )
        try:
            files = tuple(_entry(f) for f in _items(body["files"]))
            names = [f.name for f in files]
            if len(set(names)) != len(names) or MANIFEST in names:
                raise ValueError("a file is listed twice, or the manifest lists itself")
            absent = [n for n in REQUIRED if n not in names]
            if absent:
                raise ValueError(f"it lists no {absent}")
            world_size = _int(body["world_size"])
            if stray := [f"{f.name} by rank {f.rank}" for f in files if f.rank >= world_size]:
                raise ValueError(f"it lists files written by no rank of its world_size {world_size} ({stray[0]})")
            shape, dims = body["mesh_shape"], body["mesh_dim_names"]
            manifest = cls(
                _opt_int(body["step"]),
                _opt_int(body["epoch"]),
                world_size,
                None if shape is None else tuple(_int(n) for n in _items(shape)),
                None if dims is None else tuple(_str(n) for n in _items(dims)),
                _int(body["writers"]),
                tuple(_str(c) for c in _items(body["contents"])),
                files,
                _str(body["save_id"]),
                _time(body["saved_at"]),
                _str(body["torch_version"]),
                _str(body["dist_resume_version"]),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise _damaged(where, f"{type(err).__name__}: {str(err)[:200]}") from err
        return manifest


def _damaged(where: str, what: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"{where} is damaged ({what}); the folder does not count as a checkpoint: resume from an earlier one"
    )


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number a manifest holds")


def _items(value: Any) -> list[Any]:
    if not isinstance(value, list) or len(value) > _MAX_ITEMS:
        raise ValueError(f"{described(value, 60)} is not a list")
    return value


def _int(value: Any) -> int:
    if (problem := count_problem(value)) is not None:
        raise ValueError(problem)
    return int(value)


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)


def _time(value: Any) -> float:
    if (problem := time_problem(value)) is not None:
        raise ValueError(f"saved_at {problem}")
    return float(value)


def _str(value: Any) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT:
        raise ValueError(f"{described(value, 60)} is not a str of at most {_MAX_TEXT} characters")
    return value


def _entry(value: Any) -> FileEntry:
    if not isinstance(value, dict):
        raise ValueError(f"a file entry is {type(value).__name__}, not an object")
    name = _str(value["name"])
    bad_name = check_name(name)
    if bad_name is not None:
        raise ValueError(f"file name {bad_name}, not a name inside the folder")
    crc = _str(value["crc32"])
    if not re.fullmatch(r"[0-9a-f]{8}", crc):
        raise ValueError(f"crc32 {crc[:20]!r} is not 8 hex digits")
    return FileEntry(name, _int(value["size"]), int(crc, 16), _int(value["rank"]))


def read_manifest(folder: Location) -> tuple[Manifest, bytes]:
    """The folder's :class:`Manifest` and the manifest's bytes (what a digest covers). Local; reads one small file.

    A folder without ``manifest.json`` raises :class:`NotACheckpointError` (its save never finished, or it
    was copied in part); one whose manifest does not parse :class:`CheckpointCorruptError`.
    """
    root = folder
    where = f"checkpoint {str(root)!r}"
    try:
        data = read_in_folder(root, MANIFEST, _MAX_MANIFEST)
    except CheckpointNotFoundError as err:
        raise NotACheckpointError(
            f"{where} has no {MANIFEST}: its save did not finish (a killed save is never renamed to this name, "
            "so the folder was copied or edited in part); it does not count as a checkpoint: resume from an "
            "earlier one, or copy the whole folder again"
        ) from err
    except OSError as err:
        raise CheckpointCorruptError(f"cannot read {str(root / MANIFEST)!r}: {err.strerror or err}") from err
    with untrusted(where, MANIFEST):
        return Manifest.from_json(data, f"{where}: {MANIFEST}"), data
