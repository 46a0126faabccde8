"""Is this a complete dist_resume checkpoint, and is it the same one another rank sees?

The byte-level checks (zip structure, the CRC-32 of every record, a refusing unpickler that reads
no tensor data) live in :mod:`dist_resume._format.archive`, a sharded checkpoint folder's manifest in
:mod:`dist_resume._format.manifest`; this module adds what a checkpoint folder needs on top: the
dist_resume metadata, and a cheap digest that identifies one save (a file's zip directory, a sharded
folder's manifest).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Final

from .._core.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError
from .._core.location import Location, local_path, looked_up
from .._core.types import PathLike
from .._core.untrusted import untrusted
from .._foreign.folders import foreign_kind, trainer_progress
from .._foreign.safetensors_read import SAFETENSORS_SUFFIX, is_safetensors, read_safetensors_header
from .._foreign.sharded import checked_layout
from .._format.archive import read_archive
from .._format.manifest import TRAIN_STATE, read_manifest
from .._format.records import read_records
from .._format.safe_open import open_checkpoint_file, reading
from .._format.sharded_files import FileProblem, declared_keys, manifest_problems
from .._format.sharded_layout import lost_keys_problem
from .._format.sniff import FileKind, file_kind
from .._format.zip_verify import ArchiveFinding, FindingKind, integrity_failure, verify_zip
from .._layout.layout import Layout, split_checkpoint
from .._layout.meta import Key, is_toolkit, toolkit_meta
from .._store.url import location

__all__ = [
    "CheckpointInfo",
    "archive_digest",
    "checkpoint_identity",
    "inspect_checkpoint",
    "verify_archive",
    "verify_source",
    "source_files",
]


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A complete checkpoint file: where it is, its step, its size in bytes, and its digest.

    ``digest`` (SHA-256 over each record's name, CRC-32 and size) identifies one save: two files
    with the same digest hold the same records, and computing it reads the zip directory, not the
    tensors. A sharded checkpoint folder's digest is the SHA-256 of its manifest (every file's size and
    CRC-32, and a save id), its size the bytes of the files the manifest lists; a foreign source's digest
    covers each of its files.
    """

    path: Location
    step: int | None
    size: int
    digest: str
    layout: str = Layout.TOOLKIT.value
    files: tuple[tuple[str, int], ...] = ()  # a foreign source's files and their sizes


def archive_digest(path: Location) -> str:
    """SHA-256 over every record's name, CRC-32 and size, as the zip directory records them.

    Local; reads kilobytes (the central directory and the local headers), never tensor data. The
    CRC-32 of ``data.pkl`` covers the pickled structure and torch's per-save
    ``.data/serialization_id`` record makes every save distinct, so two saves of equal tensors
    still differ. It identifies a file; it does not check its bytes (that is
    :func:`verify_archive`).

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> len(archive_digest(Path("ckpt.pt")))
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
    dist_resume metadata (the format marker, a format version this dist_resume reads, a ``meta`` dict
    whose entries are of the types and within the ranges save_checkpoint writes: a ``step`` and ``epoch``
    from 0 to 2**63-1 or absent) and a model state (a mapping keyed by strings), every tensor in it dense
    (not sparse, nested, quantized or expanded), read by a refusing unpickler that loads no tensor data;
    what its entries hold is checked against the model by a resume, not here. This is the verdict a
    folder's readers share (the manager's choice, ``latest_checkpoint``, ``dist-resume list``). Raises
    :class:`CheckpointCorruptError`, :class:`NotACheckpointError` or
    :class:`UnsafeCheckpointError`, each naming the file.

    A sharded checkpoint folder (what an FSDP2 model saves, ``ckpt_<step>.dcp/``) must hold its
    ``manifest.json`` and every file it lists with the listed size (``verify=True``: and CRC-32), and a
    ``train_state.pt`` whose metadata is checked as a file's is and agrees with it; its ``files`` are the
    manifest's.

    A foreign source (an HF Trainer, Accelerate or DCP folder, a ``.safetensors`` file) is described
    instead: its ``layout``, its ``files`` with their sizes, the step where the source records one (HF
    Trainer's ``global_step``), and a digest over its files; ``verify=True`` checks each file as
    :func:`verify_archive` does.

    Example::

        >>> path = dist_resume.save_checkpoint("ckpt.pt", model=torch.nn.Linear(2, 2), step=3)
        >>> dist_resume.tools.inspect_checkpoint(path).step
        3
    """
    p = looked_up(location(path))
    with reading(p):  # removed meanwhile (a writer's rotation): CheckpointNotFoundError, never damage
        return _inspect(p, verify)


def _inspect(p: Location, verify: bool) -> CheckpointInfo:
    foreign = foreign_kind(p)
    if foreign is Layout.SHARDED or (p.is_dir() and p.suffix == ".dcp"):  # ckpt_<step>.dcp: ours, complete or not
        return _inspect_sharded(p, verify)
    if foreign is not None:
        return _inspect_foreign(p, foreign, verify)
    read_records(p)  # a damaged structure raises here, with the plain reason
    if verify:
        verify_zip(p)
    obj = read_archive(p).obj  # refuses tensors that are not dense, anywhere (read_archive)
    if not is_toolkit(obj) or not isinstance(obj.get(Key.META), Mapping):
        raise NotACheckpointError(
            f"{str(p)!r} is a torch file without dist_resume metadata (not written by save_checkpoint or "
            "CheckpointManager), so it is not taken as a complete checkpoint; pass the file itself to resume()"
        )
    # its parts typed (format version, meta entries of their types and ranges: toolkit_meta, a model state dict)
    step = split_checkpoint(obj, f"checkpoint {str(p)!r}").step
    return CheckpointInfo(p, step, p.stat().st_size, archive_digest(p))


_DAMAGED: Final = (
    "the files were damaged after they were written (disk, copy or transfer): copy the checkpoint again, or "
    "resume from an earlier one"
)


def _findings(problems: list[FileProblem]) -> list[ArchiveFinding]:
    return [
        ArchiveFinding(p.name, p.problem, FindingKind.CRC_MISMATCH if p.crc else FindingKind.UNREADABLE)
        for p in problems
    ]


def _inspect_sharded(p: Location, verify: bool) -> CheckpointInfo:
    manifest, raw = read_manifest(p)
    problems = manifest_problems(p, manifest, verify=verify)
    if problems:
        raise integrity_failure(repr(str(p)), _findings(problems), _DAMAGED)
    obj = read_archive(p / TRAIN_STATE).obj  # its small records' CRCs checked; no tensor data read
    where = f"sharded checkpoint {str(p)!r}: its {TRAIN_STATE}"
    if not is_toolkit(obj) or not isinstance(obj.get(Key.META), Mapping):
        raise NotACheckpointError(f"{str(p / TRAIN_STATE)!r} carries no dist_resume metadata")
    with untrusted(where, "its metadata"):
        meta = toolkit_meta(obj, where)  # what split_checkpoint checks of a file: format version, meta entries
    lost = lost_keys_problem(checked_layout(obj, repr(str(p / TRAIN_STATE))), declared_keys(p, manifest))
    if lost is not None:
        raise CheckpointCorruptError(
            f"sharded checkpoint {str(p)!r}: its {TRAIN_STATE} and .metadata disagree: {lost}; .metadata lost them: "
            "the folder is damaged, resume from an earlier checkpoint"
        )
    if meta.get("step") != manifest.step:  # (an int or None: toolkit_meta checked it)
        raise NotACheckpointError(
            f"sharded checkpoint {str(p)!r}: its manifest says step {manifest.step}, its train state step "
            f"{meta.get('step')!r}; the folder was assembled from two saves: resume from another checkpoint"
        )
    files = tuple((f.name, f.size) for f in manifest.files)
    return CheckpointInfo(p, manifest.step, manifest.size, hashlib.sha256(raw).hexdigest(), Layout.SHARDED.value, files)


def checkpoint_identity(path: Location) -> tuple[int, str]:
    """``(size, digest)`` of a checkpoint as :class:`CheckpointInfo` gives them, cheaply. Local.

    A torch file: its size and :func:`archive_digest`. A sharded checkpoint folder: the manifest's size and
    digest, once every file it lists is there with its size (reads the manifest and stats each file)."""
    p = looked_up(path)
    with reading(p):
        if not p.is_dir():
            return p.stat().st_size, archive_digest(p)
        manifest, raw = read_manifest(p)
        problems = manifest_problems(p, manifest, verify=False)
        if problems:
            raise integrity_failure(repr(str(p)), _findings(problems), _DAMAGED)
        return manifest.size, hashlib.sha256(raw).hexdigest()


def source_files(path: Location) -> list[Location]:
    """The files a checkpoint source consists of: the file itself, or a folder's files by name. Local."""
    p = path
    return sorted((f for f in p.iterdir() if f.is_file()), key=lambda f: f.name) if p.is_dir() else [p]


def _inspect_foreign(p: Location, layout: Layout, verify: bool) -> CheckpointInfo:
    if verify:
        verify_source(p)
    files = source_files(p)
    digest = hashlib.sha256()
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        if _is_zip(f):
            digest.update(archive_digest(f).encode())
        elif f.suffix == SAFETENSORS_SUFFIX:
            read_safetensors_header(f)  # a damaged header raises here, naming the file
            with open_checkpoint_file(f) as fh:
                digest.update(fh.read(int.from_bytes(fh.read(8), "little")))
    step = trainer_progress(local_path(p, "an HF Trainer folder"))[0] if layout is Layout.HF_TRAINER else None
    sizes = tuple((f.name, f.stat().st_size) for f in files)
    return CheckpointInfo(p, step, sum(n for _, n in sizes), digest.hexdigest(), layout.value, sizes)


def _is_zip(f: Location) -> bool:
    try:
        return file_kind(f) is FileKind.ZIP
    except OSError:
        return False


def verify_archive(
    path: PathLike, *, strict: bool = True, progress: Callable[[int, int], None] | None = None
) -> list[ArchiveFinding]:
    """Check a checkpoint's bytes: a torch zip file's structure and the CRC-32 of every record. Local.

    ``torch.load`` never checks the CRCs, so a flipped bit loads silently; this finds it. Returns
    the findings (empty when the checkpoint is sound); with ``strict=True`` (default) any finding
    raises :class:`CheckpointCorruptError` naming the first few. ``progress(done, total)`` is
    called with byte counts while checksumming a torch file. A folder (HF Trainer, Accelerate, DCP)
    is checked file by file (each torch file's CRCs, each safetensors header and its offsets; DCP's
    ``.distcp`` files carry no checksums, their sizes are checked when DCP reads them), and each
    finding names its file. A ``.safetensors`` file has its header and offsets checked.

    Example::

        >>> torch.save({"w": torch.ones(2)}, "ckpt.pt")
        >>> verify_archive("ckpt.pt")
        []
    """
    p = location(path)
    if p.is_dir() or p.suffix == SAFETENSORS_SUFFIX:
        return verify_source(p, strict=strict)
    return verify_zip(p, strict=strict, progress=progress)  # a file removed meanwhile: CheckpointNotFoundError


def verify_source(path: Location, *, strict: bool = True) -> list[ArchiveFinding]:
    """Check every file of a source: each torch zip file's CRC-32s, each safetensors header and its offsets. Local.

    ``path`` is a file or a foreign checkpoint folder (reads every torch file in it once); a sharded
    checkpoint folder is checked against its manifest (every file's size and CRC-32). DCP's
    ``.distcp`` files carry no checksums; their sizes are checked when DCP reads them. Returns the
    findings, each naming its file; with ``strict=True`` (default) any finding raises
    :class:`CheckpointCorruptError` naming the first few.

    Example::

        >>> verify_source("out/checkpoint-500")
        []
    """
    p = path
    with reading(p):  # removed meanwhile (a writer's rotation): CheckpointNotFoundError, never damage
        return _verify_source(p, strict)


def _verify_source(p: Location, strict: bool) -> list[ArchiveFinding]:
    if foreign_kind(p) is Layout.SHARDED:
        findings = _findings(manifest_problems(p, read_manifest(p)[0], verify=True))
        if findings and strict:
            raise integrity_failure(repr(str(p)), findings, _DAMAGED)
        return findings
    findings = []
    for f in source_files(p):
        where = f.name if p.is_dir() else None
        if f.suffix == SAFETENSORS_SUFFIX or is_safetensors(f):
            try:
                read_safetensors_header(f)
            except CheckpointError as err:
                findings.append(ArchiveFinding(where, str(err), FindingKind.UNREADABLE))
        elif _is_zip(f):
            for finding in verify_zip(f, strict=False):
                record = f"{where}: {finding.record}" if where and finding.record else where or finding.record
                findings.append(ArchiveFinding(record, finding.problem, finding.kind))
    if findings and strict:
        raise integrity_failure(repr(str(p)), findings, _DAMAGED)
    return findings
