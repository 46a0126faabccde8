"""Writing an object on a store: a streamed upload committed by its last write, and a put that only creates.

:func:`upload` streams what ``write`` writes as a multipart upload (s3fs, gcsfs, adlfs: their buffered files with
``autocommit=False``), holding one part (:data:`PART_BYTES`) at a time; the object appears under its name only when
:func:`upload` completes the upload (S3's ``CompleteMultipartUpload``, GCS's final resumable request, Azure's block
list commit): an upload that fails is aborted, and one whose process is killed is never completed, so nothing is
visible. Stores without such a file (``memory://``, and protocols dist_resume does not know) get the whole object in
one put at the end, from a local temporary file.

:func:`put_if_absent` is a conditional put (S3's ``If-None-Match: *``) where :func:`conditional_put` says the store
makes one; elsewhere it is a check and then a put.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable
from typing import Any, BinaryIO, Final

from .._core.location import RemotePath

__all__ = ["PART_BYTES", "STREAMING", "upload", "put_if_absent", "conditional_put", "abort_unfinished"]

# the library logger (:mod:`dist_resume._core.log`, which imports torch: this module is read by torch-free commands)
logger = logging.getLogger("dist_resume")

PART_BYTES: Final = 16 << 20  # one part of a multipart upload: S3 wants 5 MiB or more (all but the last part)
STREAMING: Final = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_CONDITIONAL: Final = frozenset({"s3", "s3a", "memory"})
_ONE_PUT: Final = frozenset({"memory"})  # a put that replaces the whole object at once
_warned: set[str] = set()


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
