"""An object (or a prefix of objects) on a store that fsspec reaches: :class:`RemotePath`, the ``pathlib.Path`` methods
the toolkit uses, answered with the store's own requests; :data:`Location`, a local path or one of those.

A ``RemotePath`` has no local path: its ``__fspath__`` raises, so handed to ``open()``, ``os.listdir``, ``torch.load``
or ``pathlib.Path()`` by mistake it raises ``TypeError`` instead of becoming a local path (``pathlib.Path("s3://b/run")``
is the relative path ``s3:/b/run``, FACTS 38). :func:`dist_resume._store.url.location` makes one from a URL; what it cannot do as a path
(rename, lock, mmap) has its own owner: :mod:`dist_resume._store.ranges` reads, :mod:`dist_resume._store.upload`
writes, :mod:`dist_resume._manager.lease` is the one writer's lease. Torch-free; fsspec is imported on first use.

Object stores have no folders: a "folder" is a prefix, which exists while an object lies under it. Listings ask the
store again each time (``refresh``): a cached listing would hide a checkpoint another process just committed.
"""

from __future__ import annotations

import datetime
import hashlib
import posixpath
import stat as stat_module
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeAlias

__all__ = ["RemotePath", "RemoteStat", "Location", "stat_of", "is_remote", "local_path", "looked_up"]

_BUCKETED: Final = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_MTIME_KEYS: Final = ("LastModified", "last_modified", "mtime", "updated", "created", "modified")


@dataclass(frozen=True, slots=True)
class RemoteStat:
    """What ``os.stat`` says of a file, as a store says it of an object (:meth:`RemotePath.stat`): size, modification
    time, and an identity that changes whenever the object is written again (its ETag or generation, hashed into
    ``st_ino``). Local."""

    st_size: int
    st_mtime_ns: int
    st_ino: int
    etag: str
    is_dir: bool = False
    st_dev: int = 0

    @property
    def st_mtime(self) -> float:
        return self.st_mtime_ns / 1e9

    @property
    def st_mode(self) -> int:
        return stat_module.S_IFDIR if self.is_dir else stat_module.S_IFREG


def _mtime_ns(info: Mapping[str, Any]) -> int:
    for key in _MTIME_KEYS:
        value = info.get(key)
        if isinstance(value, datetime.datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value * 1e9)
        if isinstance(value, str):
            try:
                return int(datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    return 0


def _etag(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "version_id", "VersionId", "md5Hash", "content_md5"):
        value = info.get(key)
        if value:
            return str(value).strip('"')
    return f"{info.get('size')}-{_mtime_ns(info)}"


def stat_of(info: Mapping[str, Any]) -> RemoteStat:
    """A :class:`RemoteStat` from an fsspec ``info()`` or ``ls(detail=True)`` entry."""
    etag = _etag(info)
    is_dir = info.get("type") == "directory"
    ino = int(hashlib.sha256(etag.encode()).hexdigest()[:15], 16)
    return RemoteStat(int(info.get("size") or 0), _mtime_ns(info), ino, etag, is_dir)


@dataclass(frozen=True, eq=False)
class RemotePath:
    """A checkpoint (or a folder of them) on an object store: ``protocol://key`` on the store fsspec implements for
    ``protocol``, reached with ``options`` (fsspec's ``storage_options``: credentials, endpoint, ...) and read through
    a local copy in ``cache_dir`` when one is given.

    What the toolkit returns for a URL where it returns a ``pathlib.Path`` for a local path (``save_checkpoint``,
    ``CheckpointManager.save`` and ``checkpoints()``, ``ResumeResult.path``, ...): ``str()`` gives the URL, and
    ``name``, ``suffix``, ``parent``, ``/``, ``exists()``, ``is_file()``, ``is_dir()``, ``iterdir()``, ``stat()``,
    ``read_bytes()`` and ``unlink()`` answer as a ``Path``'s do, each with the store's requests. It has no local
    path: ``os.fspath()`` of it raises ``TypeError``, so ``open()``, ``torch.load`` or ``pathlib.Path()`` of one fail
    loudly instead of making a local path of it. Pass it (or its URL) back to any function of dist_resume. Local.

    Equal paths name the same object: the options and the cache folder are how it is reached, not what it is.
    ``host`` is the URL's host where fsspec's path leaves it out (``h`` of ``hdfs://h/run``, whose key is ``/run``; the
    backend reaches it through the options), so that ``str()`` gives back the URL as written.
    ``_known`` is what a listing already said of the entry (its type and stat), so that ``is_file()`` on a listed
    child asks nothing more.

    Example::

        >>> path = dist_resume.save_checkpoint("memory://example/ckpt.pt", model=torch.nn.Linear(2, 2), step=3)
        >>> path, path.name, path.exists()
        (RemotePath('memory://example/ckpt.pt'), 'ckpt.pt', True)
    """

    protocol: str
    key: str  # fsspec's path: the URL without its protocol ("bucket/run/ckpt_00000100.pt"; "/run" for memory://)
    options: tuple[tuple[str, Any], ...] = ()
    cache_dir: str | None = None
    _known: RemoteStat | None = field(default=None, repr=False)
    host: str = ""

    # --- what it is called --------------------------------------------------------------------------------------

    def __str__(self) -> str:
        host = f"{self.host}/" if self.host else ""
        return f"{self.protocol}://{host}{self.key.lstrip('/')}"

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RemotePath):
            return False
        return (self.protocol, self.host, self.key) == (other.protocol, other.host, other.key)

    def __hash__(self) -> int:
        return hash((self.protocol, self.host, self.key))

    def __lt__(self, other: RemotePath) -> bool:  # sorted((step, path)) of a listing compares paths on equal steps
        return str(self) < str(other)

    def __fspath__(self) -> str:
        """Refused: an object on a store has no local path. ``open()``, ``os.stat``, ``torch.load`` and
        ``pathlib.Path()`` all ask for one, and each raises this ``TypeError`` instead of reading or writing a local
        file named like the URL (FACTS 38)."""
        raise TypeError(
            f"{self} is on an object store, not a local path: read it with dist_resume (load_checkpoint, resume, "
            "tools.*), or copy it to local disk first"
        )

    def __truediv__(self, name: str) -> RemotePath:
        return self._child(f"{self.key.rstrip('/')}/{name}")

    def _child(self, key: str, known: RemoteStat | None = None) -> RemotePath:
        return RemotePath(self.protocol, key, self.options, self.cache_dir, known, self.host)

    @property
    def name(self) -> str:
        return posixpath.basename(self.key.rstrip("/"))

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    @property
    def stem(self) -> str:
        return posixpath.splitext(self.name)[0]

    @property
    def parent(self) -> RemotePath:
        parent = posixpath.dirname(self.key.rstrip("/"))
        return self._child(parent or self.key)

    @property
    def bucket(self) -> RemotePath | None:
        """The bucket (container) the object is in: the key's first component, on stores that have buckets (S3, GCS,
        Azure); None elsewhere (``memory://``)."""
        if self.protocol not in _BUCKETED:
            return None
        return self._child(self.key.lstrip("/").split("/", 1)[0])

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def absolute(self) -> RemotePath:
        return self

    def resolve(self) -> RemotePath:
        return self

    # --- what the store says ------------------------------------------------------------------------------------

    @property
    def fs(self) -> Any:
        """The fsspec filesystem (fsspec keeps one instance per protocol and options)."""
        import fsspec

        return fsspec.filesystem(self.protocol, **dict(self.options))

    def info(self) -> dict[str, Any]:
        """The store's description of the object or prefix, asked afresh. Raises ``FileNotFoundError``."""
        fs = self.fs
        fs.invalidate_cache(self.key)
        info: dict[str, Any] = fs.info(self.key)
        return info

    def stat(self) -> RemoteStat:
        if self._known is not None and not self._known.is_dir:
            return self._known
        return stat_of(self.info())

    def looked_up(self) -> RemotePath:
        """This path with its stat asked of the store once (itself when a listing already said it): ``stat()``,
        ``is_dir()`` and reads opened on it ask no more (``exists()`` always asks). Raises ``FileNotFoundError``."""
        return self if self._known is not None else self._child(self.key, stat_of(self.info()))

    def exists(self) -> bool:
        try:
            self.info()
        except FileNotFoundError:
            return False
        return True

    def is_dir(self) -> bool:
        if self._known is not None:
            return self._known.is_dir
        try:
            return self.info().get("type") == "directory"
        except FileNotFoundError:
            return False

    def is_file(self) -> bool:
        if self._known is not None:
            return not self._known.is_dir
        try:
            return self.info().get("type") != "directory"
        except FileNotFoundError:
            return False

    def is_symlink(self) -> bool:
        return False

    def iterdir(self) -> Iterator[RemotePath]:
        """The entries directly under this prefix (objects and sub-prefixes), listed afresh. Raises
        ``FileNotFoundError`` when nothing lies under it."""
        mine = self.key.rstrip("/")
        for info in self.fs.ls(self.key, detail=True, refresh=True):
            name = str(info["name"]).rstrip("/")
            if name and name != mine:  # some stores list the prefix's own marker object
                yield self._child(name, stat_of(info))

    def read_bytes(self) -> bytes:
        data: bytes = self.fs.cat_file(self.key)
        return data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def unlink(self, *, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise
        self.fs.invalidate_cache(self.key)

    def remove_tree(self) -> None:
        """Delete the object, or every object under the prefix. A prefix already gone is fine."""
        fs = self.fs
        try:
            fs.rm(self.key, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(self.key)


Location: TypeAlias = Path | RemotePath
"""Where a checkpoint lives: a local path, or an object (prefix) on a store."""


def is_remote(path: object) -> bool:
    """Whether ``path`` is a :class:`RemotePath` (a checkpoint on an object store)."""
    return isinstance(path, RemotePath)


def local_path(path: Location, what: str) -> Path:
    """``path`` itself, a local path; a :class:`RemotePath` raises ``TypeError`` (``what`` reads local files only:
    its caller copies an object to local disk first)."""
    if isinstance(path, RemotePath):
        raise TypeError(f"{what} reads local files only, and {path} is on an object store")
    return path


def looked_up(path: Location) -> Location:
    """``path`` ready for several reads: a :class:`RemotePath` with its stat asked of the store once (as it is when
    nothing is there: the reader says so); a local path as it is."""
    if not isinstance(path, RemotePath):
        return path
    try:
        return path.looked_up()
    except FileNotFoundError:
        return path
