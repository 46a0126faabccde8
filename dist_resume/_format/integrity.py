"""Is this file a complete dist_resume checkpoint, and is it the same file another rank sees?

The byte-level checks (zip structure, the CRC-32 of every record, a refusing unpickler that reads
no tensor data) live in :mod:`dist_resume._archive`; this module adds what a checkpoint folder
needs on top: the dist_resume metadata, and a cheap digest that identifies one save.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .._core.errors import NotACheckpointError
from .._core.types import PathLike
from .archive import read_archive, read_records, verify_archive
from .layout import FORMAT_NAME, Key

__all__ = ["CheckpointInfo", "archive_digest", "inspect_checkpoint"]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint file: where it is, its step, its size in bytes, and its digest.

    ``digest`` (see :func:`archive_digest`) identifies one save: two files with the same digest
    hold the same records, and computing it reads the zip directory, not the tensors.
    """

    path: Path
    step: int | None
    size: int
    digest: str


def archive_digest(path: PathLike) -> str:
    """SHA-256 over every record's name, CRC-32 and size, as the zip directory records them.

    Local; reads kilobytes (the central directory and the local headers), never tensor data. The
    CRC-32 of ``data.pkl`` covers the pickled structure and torch's per-save
    ``.data/serialization_id`` record makes every save distinct, so two saves of equal tensors
    still differ. It identifies a file; it does not check its bytes (that is
    :func:`~dist_resume._archive.verify_archive`).

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> len(archive_digest("ckpt.pt"))
        64
    """
    _, records = read_records(path)
    digest = hashlib.sha256()
    for record in sorted(records, key=lambda r: r.name):
        digest.update(f"{record.name}\0{record.crc:08x}\0{record.file_size}\n".encode())
    return digest.hexdigest()


def inspect_checkpoint(path: PathLike, *, verify: bool = True) -> CheckpointInfo:
    """Check that ``path`` is a complete dist_resume checkpoint; return its :class:`CheckpointInfo`.

    Local. ``verify=True`` checks the zip structure and the CRC-32 of every record (reads the
    whole file once); ``verify=False`` the structure only. Either way the file must carry
    dist_resume metadata (the format marker and a ``meta`` dict with an integer or absent
    ``step``), read by a refusing unpickler that loads no tensor data. Raises
    :class:`CheckpointCorruptError`, :class:`NotACheckpointError` or
    :class:`UnsafeCheckpointError`, each naming the file.

    Example::

        >>> dist_resume.save_checkpoint("ckpt.pt", model=torch.nn.Linear(2, 2), step=3)
        >>> inspect_checkpoint("ckpt.pt").step
        3
    """
    p = Path(path)
    read_records(p)  # a damaged structure raises here, with the plain reason
    if verify:
        verify_archive(p)
    obj = read_archive(p).obj
    meta = obj.get(Key.META) if isinstance(obj, Mapping) else None
    if not isinstance(obj, Mapping) or obj.get(Key.FORMAT) != FORMAT_NAME or not isinstance(meta, Mapping):
        raise NotACheckpointError(
            f"{str(p)!r} is a torch file without dist_resume metadata (not written by save_checkpoint or "
            "CheckpointManager), so it is not taken as a complete checkpoint; pass the file itself to resume()"
        )
    step = meta.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise NotACheckpointError(f"{str(p)!r} has invalid dist_resume metadata: step is {step!r}, not an int")
    return CheckpointInfo(p, step, p.stat().st_size, archive_digest(p))
