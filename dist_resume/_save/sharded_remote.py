"""A sharded save into a folder on an object store (``s3://bucket/run/ckpt_<step>.dcp/``): every rank stages its files
on local disk (DCP writes, and the CRC-32s are read, as on a shared filesystem), uploads them, and rank 0 commits the
folder by uploading its manifest last, once it has listed every file the ranks reported.

A store has no rename, so there is no temporary name: the folder's files appear under their final names as they are
uploaded, and the folder counts only once ``manifest.json`` is there (:mod:`~dist_resume._source.listing` never lists
a folder without it). A save killed at any moment leaves files without a manifest, which ``CheckpointManager`` removes
on its next save; a save of a step already in the folder deletes that step's folder first.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .._core.errors import CheckpointWriteError
from .._core.location import RemotePath
from .._core.log import logger
from .._core.text import preview
from .._format.atomic import atomic_write, remove_path
from .._format.manifest import MANIFEST, FileEntry, Manifest
from .._store.transfer import put_file

__all__ = ["local_staging", "clear_destination", "upload_own", "commit_remote", "drop_staging"]


def local_staging(dest: RemotePath) -> Path:
    """A new folder on this rank's local disk for its files of ``dest``. Local."""
    return Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp"))


def drop_staging(tmp: Path) -> None:
    """Delete this rank's staging folder (the files are uploaded, or the save failed). Local."""
    shutil.rmtree(tmp, ignore_errors=True)


def clear_destination(dest: RemotePath) -> None:
    """Rank 0, before anything is uploaded: delete what lies under ``dest`` (a save of this step that never
    committed, or an earlier one being replaced)."""
    if dest.exists():
        committed = (dest / MANIFEST).exists()
        remove_path(dest)
        if committed:
            logger.debug("replaced the sharded checkpoint %s saved earlier for the same step", dest)


def upload_own(tmp: Path, dest: RemotePath, entries: list[FileEntry]) -> None:
    """Upload this rank's files (``entries``, read from ``tmp``) into ``dest``, each streamed. Local."""
    for entry in entries:
        put_file(tmp / entry.name, dest / entry.name)


def commit_remote(tmp: Path, dest: RemotePath, manifest: Manifest) -> None:
    """Rank 0: ``dest`` holds exactly the files the ranks reported, with their sizes, and ``.metadata`` names no other;
    then the manifest is uploaded, last: the commit."""
    from .._foreign.dcp_metadata import read_dcp_metadata

    listed = {e.name: e.size for e in manifest.files}
    found = {p.name: p.stat().st_size for p in dest.iterdir() if not p.is_dir()}
    missing = sorted(n for n, size in listed.items() if found.get(n) != size)
    unknown = sorted(set(found) - set(listed))
    shards = {e.name: e.size for e in manifest.files if e.name.endswith(".distcp")}  # rank 0 staged its own only
    named = {info.relative_path for info in (read_dcp_metadata(tmp, sizes=shards).storage_data or {}).values()}
    unnamed = sorted(named - set(listed))
    if missing or unknown or unnamed:
        raise CheckpointWriteError(
            f"the sharded checkpoint {str(dest)!r} does not hold what the ranks uploaded: missing or of another size "
            f"{preview(missing)}, not reported {preview(unknown)}, named by .metadata but not written "
            f"{preview(unnamed)}; another writer may be saving into the same folder"
        )
    atomic_write(dest / MANIFEST, lambda f: f.write(manifest.to_json()))
