"""Whole files between local disk and a store, for what reads or writes local files only (``convert``, a sharded save's
shards): :func:`fetch_tree` copies an object or a prefix down, :func:`put_file` and :func:`put_tree` copy up, each
object committed by its last write and a folder's commit files (its manifest) uploaded last."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from .._core.location import Location, RemotePath
from .ranges import RangeFile
from .upload import PART_BYTES, upload

__all__ = ["fetch_tree", "put_file", "put_tree"]


def fetch_tree(path: RemotePath, dest: Path) -> Path:
    """Copy the object ``path`` to the file ``dest``, or every object under the prefix to the folder ``dest`` (one
    level: a checkpoint folder holds files). Local; returns ``dest``."""
    if not path.is_dir():
        dest.parent.mkdir(parents=True, exist_ok=True)
        with RangeFile(path, cache=False) as src, open(dest, "wb") as out:
            for piece in src.chunks(0, src.size):
                out.write(piece)
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    for child in path.iterdir():
        if not child.is_dir():
            fetch_tree(child, dest / child.name)
    return dest


def put_file(local: Path, dest: RemotePath) -> None:
    """Upload the local file to the object ``dest``, streamed, visible once complete. Local."""
    with open(local, "rb") as src:
        upload(dest, lambda out: shutil.copyfileobj(src, out, PART_BYTES))


def put_tree(local: Path, dest: Location, *, last: Sequence[str] = ()) -> None:
    """Upload a local file, or a folder's files, to ``dest``; the files named in ``last`` (a folder's commit marker)
    after every other one. Local."""
    assert isinstance(dest, RemotePath)
    if local.is_file():
        put_file(local, dest)
        return
    files = sorted((p for p in local.iterdir() if p.is_file()), key=lambda p: (p.name in last, p.name))
    for f in files:
        put_file(f, dest / f.name)
