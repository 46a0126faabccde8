"""Telling an fsspec URL from a local path, once, at every public entry: :func:`location`.

``s3://bucket/run``, ``gs://...``, ``az://...``, ``memory://...`` (any protocol fsspec implements) become a
:class:`~dist_resume._core.location.RemotePath`; ``file:///abs/path`` and anything without a ``scheme://`` become a
``pathlib.Path``. The protocol is case-insensitive (RFC 3986: ``S3://b/run`` is ``s3://b/run``). A URL whose protocol
has no implementation installed, or whose implementation lacks a module it imports only when used (``hdfs://`` without
``pyarrow``), is a :class:`UsageError` naming what to install, and a path that ``pathlib`` already collapsed
(``Path("s3://b/run")`` is ``s3:/b/run``, FACTS 38) is refused instead of quietly becoming a folder named ``s3:`` in the
working directory.
"""

from __future__ import annotations

import importlib.util
import os
import re
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .._core.errors import UsageError
from .._core.location import Location, RemotePath

__all__ = ["URL", "is_url", "location", "extra_for"]

URL: Final = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+)(?P<chained>(::[A-Za-z][A-Za-z0-9+.-]+)*)://")
"""A URL: a protocol of two characters or more (``C:\\`` is a drive, not a protocol), then ``://``."""

# the protocol, the extra of dist_resume that installs its backend, and the backend's package
_EXTRAS: Final = {
    "s3": ("s3", "s3fs"),
    "s3a": ("s3", "s3fs"),
    "gs": ("gcs", "gcsfs"),
    "gcs": ("gcs", "gcsfs"),
    "az": ("azure", "adlfs"),
    "abfs": ("azure", "adlfs"),
    "abfss": ("azure", "adlfs"),
}
# what the implementations in these fsspec modules import only when a filesystem is made (a module, its package)
_IMPORTED_LATER: Final = {"fsspec.implementations.arrow": ("pyarrow", "pyarrow")}
# protocols worth refusing when pathlib has collapsed them ("s3:/bucket/run"), with or without fsspec installed
_COLLAPSED: Final = re.compile(r"^(?P<protocol>[A-Za-z][A-Za-z0-9+.-]+):(/|$)")
_KNOWN_WITHOUT_FSSPEC: Final = {*_EXTRAS, "memory", "http", "https", "hf", "file", "gcs", "adl", "sftp", "ftp"}


def is_url(text: object) -> bool:
    """Whether ``text`` is a ``str`` written as an fsspec URL (``protocol://...``). Local."""
    return isinstance(text, str) and URL.match(text) is not None


def extra_for(protocol: str) -> str:
    """What to install for ``protocol``: ``pip install "dist_resume[s3]"`` for ``s3``, fsspec's own advice otherwise."""
    if protocol in _EXTRAS:
        extra, package = _EXTRAS[protocol]
        return f'pip install "dist_resume[{extra}]" (it installs fsspec and {package})'
    return f"install fsspec and the fsspec implementation of {protocol}://"


def _known_protocols() -> set[str]:
    try:
        from fsspec.registry import known_implementations, registry
    except ImportError:
        return set(_KNOWN_WITHOUT_FSSPEC)
    return {*known_implementations, *registry, *_KNOWN_WITHOUT_FSSPEC}


def _refuse_collapsed(text: str) -> None:
    """Raise when ``text`` is a URL that lost one of its slashes (``s3:/bucket/run``, what ``Path(url)`` prints)."""
    found = _COLLAPSED.match(text)
    if found is None or len(found.group("protocol")) < 2:
        return
    protocol = found.group("protocol").lower()
    if protocol in _known_protocols():
        raise UsageError(
            f"{text!r} looks like a {protocol}:// URL whose '//' was collapsed (pathlib.Path('{protocol}://bucket/run') "
            f"is the local path '{protocol}:/bucket/run', a folder named '{protocol}:' in the working directory)",
            hint=f"pass the URL as a str ('{protocol}://...'), never through pathlib.Path",
        )


def _backend(url: str, protocol: str) -> None:
    """Raise :class:`UsageError` unless fsspec and an implementation of ``protocol`` can be imported."""
    try:
        import fsspec
    except ImportError as err:
        raise UsageError(
            f"{url!r} is a {protocol}:// URL, and dist_resume reads and writes URLs through fsspec, which is not "
            "installed",
            hint=extra_for(protocol),
        ) from err
    try:
        implementation = fsspec.get_filesystem_class(protocol)
    except ValueError as err:
        raise UsageError(
            f"{url!r} is a {protocol}:// URL, and fsspec knows no implementation of {protocol}://",
            hint="check the protocol's spelling (s3://, gs://, az://, memory://), or pass a local path",
        ) from err
    except ImportError as err:
        raise UsageError(
            f"{url!r} is a {protocol}:// URL, and its fsspec implementation is not installed ({err})",
            hint=extra_for(protocol),
        ) from err
    module, package = _IMPORTED_LATER.get(implementation.__module__, (None, None))
    if module is not None and importlib.util.find_spec(module) is None:
        from fsspec.registry import known_implementations

        said = known_implementations.get(protocol, {}).get("err")
        raise UsageError(
            f"{url!r} is a {protocol}:// URL, and fsspec's implementation of {protocol}:// needs the module "
            f"{module!r}, which is not installed" + (f" (fsspec: {said})" if said else ""),
            hint=f"pip install {package}",
        )


def location(
    path: Any,
    *,
    storage_options: Mapping[str, Any] | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Location:
    """``path`` as a local ``Path`` or a :class:`RemotePath` (a URL), decided here and nowhere else. Local.

    ``storage_options`` (fsspec's: credentials, ``endpoint_url``, ``anon``, ...) and ``cache_dir`` (a local folder
    keeping copies of the objects read, see :mod:`~dist_resume._store.ranges`) apply to a URL only; given with a
    local path they are a :class:`UsageError`. Credentials and endpoints otherwise come the standard way, from the
    variables and files the backend reads (``AWS_*``, ``AWS_ENDPOINT_URL``, ``GOOGLE_APPLICATION_CREDENTIALS``, ...).

    Example::

        >>> location("ckpts")
        PosixPath('ckpts')
        >>> location("memory://run")
        RemotePath('memory://run')
    """
    if isinstance(path, RemotePath):
        if storage_options is None and cache_dir is None:
            return path
        return _remote(str(path), path.protocol, storage_options, cache_dir)
    if isinstance(path, (str, os.PathLike)):
        text = os.fspath(path)
    else:
        raise TypeError(f"expected a path or a URL (str or os.PathLike), got {type(path).__name__} {path!r}")
    if not isinstance(text, str):
        raise TypeError(f"expected a str path or URL, got {type(text).__name__} {text!r}")
    found = URL.match(text)  # a pathlib.Path never holds "://" (it collapses it); another os.PathLike may (UPath)
    if found is None:
        _refuse_collapsed(text)
        if storage_options is not None or cache_dir is not None:
            raise UsageError(
                f"storage_options= and cache_dir= apply to a URL (s3://, gs://, ...), and {text!r} is a local path",
                hint="drop them, or pass the URL of the object store",
            )
        return Path(text)
    protocol = found.group("protocol").lower()
    text = protocol + text[len(protocol) :]  # S3://bucket/run is s3://bucket/run; the rest keeps its case
    if found.group("chained"):
        raise UsageError(
            f"{text!r} chains fsspec protocols, which dist_resume does not read",
            hint="pass the store's own URL (s3://...), and cache_dir= for a local copy of what is read",
        )
    if protocol == "file":
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise UsageError(f"{text!r} names the host {parsed.netloc!r}", hint="write file:///absolute/path")
        return Path(urllib.parse.unquote(parsed.path))
    return _remote(text, protocol, storage_options, cache_dir)


def _remote(
    url: str,
    protocol: str,
    storage_options: Mapping[str, Any] | None,
    cache_dir: str | os.PathLike[str] | None,
) -> RemotePath:
    _backend(url, protocol)
    import fsspec

    implementation = fsspec.get_filesystem_class(protocol)
    key = implementation._strip_protocol(url).rstrip("/") or "/"
    # what the URL itself says of how to reach the store (hdfs://h:8020/run: host and port), then the caller's options
    from_url = implementation._get_kwargs_from_urls(url)
    options = tuple(sorted((str(k), v) for k, v in {**from_url, **(storage_options or {})}.items()))
    cache = None if cache_dir is None else os.fspath(Path(cache_dir).absolute())
    return RemotePath(protocol, key, options, cache, host=_host(url, key))


def _host(url: str, key: str) -> str:
    """What ``url`` holds between ``://`` and the part fsspec's ``key`` keeps: the host of ``hdfs://h/run`` (key
    ``/run``), "" where the key keeps it all (``s3://bucket/run``, ``memory://run``)."""
    rest = url.split("://", 1)[1].rstrip("/")
    path = key.strip("/")
    if path and not rest.endswith(path):
        return ""  # a key that is not the URL's tail: nothing to add to it
    return rest[: len(rest) - len(path)].strip("/")
