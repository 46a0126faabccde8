"""Writing an object on a store: a streamed upload committed by its last write, and a put that only creates.

:func:`upload` streams what ``write`` writes as a multipart upload (s3fs, gcsfs, adlfs: their buffered files with
``autocommit=False``), holding one part (:data:`PART_BYTES`) at a time; the object appears under its name only when
:func:`upload` completes the upload (S3's ``CompleteMultipartUpload``, GCS's final resumable request, Azure's block
list commit): an upload that fails is aborted, and one whose process is killed is never completed, so nothing is
visible. Stores without such a file (``memory://``, and protocols dist_resume does not know) get the whole object in
one put at the end, from a local temporary file.

:func:`put_if_absent` is a conditional put (S3's ``If-None-Match: *``) where :func:`conditional_put` says the store
makes one; elsewhere it is a check and then a put. :func:`read_tagged` reads an object with a tag that changes whenever
it is written again (S3: its ETag, from the same GET), and :func:`put_if_unchanged` replaces it only while it still
has that tag (S3's ``If-Match``; ``memory://``: under a lock of this process): of two writers replacing the same
object, exactly one succeeds.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
from collections.abc import Callable
from typing import Any, BinaryIO, Final

from .._core.location import RemotePath

__all__ = [
    "PART_BYTES",
    "STREAMING",
    "upload",
    "put_if_absent",
    "conditional_put",
    "read_tagged",
    "put_if_unchanged",
    "abort_unfinished",
]

# the library logger (:mod:`dist_resume._core.log`, which imports torch: this module is read by torch-free commands)
logger = logging.getLogger("dist_resume")

PART_BYTES: Final = 16 << 20  # one part of a multipart upload: S3 wants 5 MiB or more (all but the last part)
STREAMING: Final = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_CONDITIONAL: Final = frozenset({"s3", "s3a", "memory"})
_ONE_PUT: Final = frozenset({"memory"})  # a put that replaces the whole object at once
_S3: Final = frozenset({"s3", "s3a"})
# S3's answers to a conditional put that lost: the object changed (412), a concurrent conditional write (409)
_LOST_RACE: Final = frozenset({"PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"})
_warned: set[str] = set()
_swap_lock = threading.Lock()  # elsewhere than S3: the compare and the put of put_if_unchanged, one at a time here


def conditional_put(path: RemotePath) -> bool:
    """Whether ``path``'s store makes :func:`put_if_absent` one conditional request (S3's ``If-None-Match``;
    ``memory://`` within one process), rather than a check followed by a put."""
    return path.protocol in _CONDITIONAL


def put_if_absent(path: RemotePath, data: bytes) -> bool:
    """Write ``data`` at ``path`` unless an object is there already; whether it was written. Local."""
    fs = path.fs
    try:
        fs.pipe_file(path.key, data, mode="create")
    except FileExistsError:
        return False
    finally:
        fs.invalidate_cache(path.key)
    return True


def read_tagged(path: RemotePath) -> tuple[bytes, str] | None:
    """The object at ``path`` and its tag, which changes whenever the object is written again (S3: the ETag of the
    same GET; elsewhere: the SHA-256 of its bytes), or None where there is no object. Local."""
    fs = path.fs
    if path.protocol in _S3:
        from fsspec.asyn import sync  # s3fs is an fsspec async filesystem: its response body is read on its loop

        bucket, key, _ = fs.split_path(path.key)
        try:
            response = fs.call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        body = response["Body"]
        try:
            data = bytes(sync(fs.loop, body.read))
        finally:
            body.close()
        return data, str(response["ETag"])
    try:
        data = bytes(fs.cat_file(path.key))
    except FileNotFoundError:
        return None
    return data, hashlib.sha256(data).hexdigest()


def _lost_race(err: OSError) -> bool:
    """Whether s3fs's ``err`` is S3 refusing a conditional put (s3fs keeps the botocore error as the cause)."""
    response = getattr(err.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return isinstance(err, FileNotFoundError) or code in _LOST_RACE


def put_if_unchanged(path: RemotePath, data: bytes, tag: str) -> bool:
    """Replace the object at ``path`` with ``data`` only while it still has ``tag`` (from :func:`read_tagged`);
    whether it was replaced. S3: one request with ``If-Match``; ``memory://``: the compare and the put under one lock
    of this process; other stores: the same, which another process can interleave with. Local."""
    fs = path.fs
    if path.protocol in _S3:
        try:
            fs.pipe_file(path.key, data, IfMatch=tag)
        except OSError as err:
            if _lost_race(err):
                return False
            raise
        finally:
            fs.invalidate_cache(path.key)
        return True
    with _swap_lock:
        current = read_tagged(path)
        if current is None or current[1] != tag:
            return False
        fs.pipe_file(path.key, data)
        fs.invalidate_cache(path.key)
    return True


def upload(path: RemotePath, write: Callable[[BinaryIO], Any]) -> None:
    """Stream what ``write(f)`` writes into the object ``path``, visible under its name only once it is complete.

    Local. Raises what the store or ``write`` raised, after aborting the upload: nothing is visible then, and an
    object already at ``path`` is untouched.
    """
    fs = path.fs
    if path.protocol in STREAMING:
        f = fs.open(path.key, "wb", autocommit=False, block_size=PART_BYTES)
        try:
            write(f)
            f.close()  # the last part goes up; with autocommit=False nothing is completed yet
            f.commit()  # the commit: the object appears, whole
        except BaseException:
            try:
                f.discard()  # aborts the multipart upload: its parts are deleted
            except Exception as abort_err:  # the store's lifecycle rule cleans up what is left
                logger.warning("could not abort the upload of %s: %s", path, abort_err)
            raise
        finally:
            fs.invalidate_cache(path.key)
        return
    if path.protocol not in _ONE_PUT and path.protocol not in _warned:
        _warned.add(path.protocol)
        logger.log(
            logging.WARNING,
            "dist_resume does not know whether a put on %s:// is atomic: a reader may see %s before it is complete; "
            "object stores with multipart uploads (s3://, gs://, az://) commit a checkpoint by its last write",
            path.protocol,
            path,
        )
    with tempfile.TemporaryFile() as spool:
        write(spool)
        spool.seek(0)
        if path.protocol in _ONE_PUT:
            fs.pipe_file(path.key, spool.read())
        else:
            with fs.open(path.key, "wb") as out:
                while chunk := spool.read(PART_BYTES):
                    out.write(chunk)
    fs.invalidate_cache(path.key)


def abort_unfinished(folder: RemotePath, wanted: Callable[[str], bool]) -> list[str]:
    """Abort the unfinished multipart uploads of the objects directly in ``folder`` whose names ``wanted`` accepts, and
    return their URLs. Local. An upload whose process was killed is never visible, but S3 keeps its parts (and bills
    them) until it is aborted or a lifecycle rule ends it. S3 only ([] on other stores); failures are logged."""
    if folder.protocol not in ("s3", "s3a"):
        return []
    bucket, _, prefix = folder.key.strip("/").partition("/")
    prefix = f"{prefix}/" if prefix else ""
    fs = folder.fs
    try:
        listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    except Exception as err:  # no permission to list uploads: the lifecycle rule is the fallback
        logger.warning("could not list the unfinished uploads under %s: %s", folder, err)
        return []
    aborted = []
    for upload_info in listed.get("Uploads", []):
        key = str(upload_info.get("Key", ""))
        name = key[len(prefix) :]
        if "/" in name or not wanted(name):
            continue
        try:
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_info["UploadId"])
            aborted.append(f"{folder.protocol}://{bucket}/{key}")
        except Exception as err:
            logger.warning("could not abort the unfinished upload of s3://%s/%s: %s", bucket, key, err)
    return aborted
