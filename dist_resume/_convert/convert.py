"""Converting a checkpoint: model keys between single-process and DDP form, and between file formats.

====================  ======================================================================
SRC -> format          what is written
====================  ======================================================================
``.pt`` -> pt          the same layout; the detected model entry and optimizer ``param_names``
                       re-keyed in place (``to``), ``argparse.Namespace`` as a plain dict;
                       tensor records copied byte for byte
``.pt`` -> safetensors the model weights, plain keys unless ``to=ddp``; bytes copied
``.pt`` -> dcp         ``{"model", "optim"}`` keyed by FQN as DSD's ``get_state_dict`` gives them
``.pt`` -> sharded     dist_resume's sharded checkpoint folder (an FSDP2 save's form), written by
                       one process, loadable at any world size
``.safetensors`` -> pt a dist_resume checkpoint holding the weights; bytes copied
folder -> pt           HF Trainer / Accelerate / DCP folders as a dist_resume checkpoint
sharded folder -> pt   the one file a DDP save would have written (RNG, sampler, scheduler kept)
====================  ======================================================================
"""

from __future__ import annotations

import dataclasses
import enum
import tempfile
import time
import zipfile
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .._core.errors import CheckpointWriteError, KeyMismatchError, UsageError
from .._core.location import Location, RemotePath
from .._core.text import article
from .._core.types import PathLike
from .._core.untrusted import untrusted
from .._foreign.folders import checkpoint_subfolders, detect_folder, read_foreign_folder, unrecognised_folder
from .._foreign.safetensors_read import is_safetensors
from .._format.archive import read_archive
from .._format.atomic import remove_path
from .._format.manifest import DCP_METADATA, MANIFEST
from .._format.pickle_write import dump_pickle
from .._format.zip_verify import verify_zip
from .._layout.layout import Layout, split_checkpoint
from .._source.integrity import verify_source
from .._state.prefix import prefix_style
from .._store.transfer import fetch_tree, put_tree
from .._store.url import location
from .archive_write import rewrite_archive
from .formats import (
    ConvertFormat,
    WriterReport,
    parts_to_pt,
    plain_namespaces,
    pt_to_dcp,
    pt_to_safetensors,
    safetensors_to_pt,
)
from .output import check_paths, remove_stale_temps, write_locked
from .rekey import KeyForm, rekey_param_names, rekey_state_dict, target_key
from .sharded_convert import pt_to_sharded, sharded_to_pt

__all__ = [
    "KeyForm",
    "ConvertFormat",
    "ConvertResult",
    "convert_checkpoint",
    "target_key",
    "remove_stale_temps",
]

Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_checkpoint` did."""

    src: Location
    dst: Location
    to: KeyForm | None
    layout: enum.Enum
    prefix_before: str
    prefix_after: str
    model_keys: int
    renamed_keys: int
    param_names: int
    bytes_written: int
    seconds: float
    format: ConvertFormat = ConvertFormat.PT


class _Source(enum.Enum):
    PT = "a torch zip checkpoint"
    SAFETENSORS = "a .safetensors file"
    FOLDER = "a checkpoint folder"
    SHARDED = "a sharded checkpoint folder"


def _source_kind(src: Path) -> _Source:
    if src.is_dir():
        kind = detect_folder(src)
        if kind is Layout.SHARDED:
            return _Source.SHARDED
        if kind is not None:  # HF Trainer, Accelerate or DCP
            return _Source.FOLDER
        if checkpoint_subfolders(src):  # an HF output_dir: name the checkpoint folders inside
            raise unrecognised_folder(src)
        raise UsageError(
            f"SRC {str(src)!r} is a folder of no kind dist_resume knows",
            "give a .pt/.ckpt/.safetensors file, an HF Trainer or Accelerate folder, a DCP folder, or a sharded "
            "checkpoint folder (ckpt_<step>.dcp/)",
        )
    return _Source.SAFETENSORS if is_safetensors(src) else _Source.PT


def _unsupported(kind: _Source, fmt: ConvertFormat) -> UsageError:
    return UsageError(
        f"converting {kind.value} to {fmt.value} is not supported",
        f"convert it to pt first (dist-resume convert SRC mid.pt --format pt), then mid.pt to {fmt.value}",
    )


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    to: KeyForm | str | None = None,
    *,
    format: ConvertFormat | str = ConvertFormat.PT,
    part_keys: Mapping[str, str] | None = None,
    force: bool = False,
    check_crc: bool = False,
    progress: Progress | None = None,
) -> ConvertResult:
    """Write ``dst``: ``src`` in ``format``, with model keys and optimizer ``param_names`` in the ``to`` form.

    Local. See the module docstring for what each direction writes; ``part_keys`` names the entry of
    each part where detection should not decide (``{"model": "MODEL_STATE"}``). ``.pt`` to ``.pt`` and
    ``.safetensors`` reads only ``src``'s data.pkl and copies tensor records byte for byte, as does
    ``.safetensors`` to ``.pt``. A sharded checkpoint folder (what an FSDP2 model saves, ``ckpt_<step>.dcp/``)
    becomes the one file a DDP save would have written, and ``format="sharded"`` turns a file into such a
    folder (loadable at any world size). ``dst`` appears atomically (temp file or folder, fsync, rename) or not
    at all. ``src`` and ``dst`` may be URLs (``s3://...``): a source on a store is copied to a local temporary
    folder first, and the output uploaded from one (a folder's manifest last).

    Example::

        >>> torch.save({"fc.weight": torch.ones(2, 2)}, "single.pt")
        >>> convert_checkpoint("single.pt", "ddp.pt", KeyForm.DDP).prefix_after
        'module.'
        >>> convert_checkpoint("single.pt", "model.safetensors", format="safetensors").model_keys
        1
    """
    start = time.perf_counter()
    src_at, dst_at = location(src), location(dst)
    form = _as_enum(KeyForm, to, "to") if to is not None else None
    fmt = _as_enum(ConvertFormat, format, "format")
    folder = fmt in (ConvertFormat.DCP, ConvertFormat.SHARDED)
    if isinstance(src_at, Path) and isinstance(dst_at, Path):
        check_paths(src_at, dst_at, force, folder=folder)
        return _convert(src_at, dst_at, form, fmt, part_keys, check_crc, progress, start)
    if src_at == dst_at:
        raise UsageError(f"SRC and DST are the same ({str(src_at)!r})", "write to a new name")
    if dst_at.exists() and not force:
        raise UsageError(f"DST {str(dst_at)!r} already exists", "pass --force to replace it")
    with tempfile.TemporaryDirectory(prefix="dist_resume-convert-") as tmp:  # a store's side goes through local disk
        local_src = fetch_tree(src_at, Path(tmp) / "src" / src_at.name) if isinstance(src_at, RemotePath) else src_at
        local_dst = Path(tmp) / "dst" / dst_at.name if isinstance(dst_at, RemotePath) else dst_at
        local_dst.parent.mkdir(exist_ok=True)
        check_paths(local_src, local_dst, force, folder=folder)
        result = _convert(local_src, local_dst, form, fmt, part_keys, check_crc, progress, start)
        if isinstance(dst_at, RemotePath):
            if force:
                remove_path(dst_at)
            put_tree(local_dst, dst_at, last=(DCP_METADATA, MANIFEST))
    return dataclasses.replace(result, src=src_at, dst=dst_at, seconds=time.perf_counter() - start)


def _convert(
    src_path: Path,
    dst_path: Path,
    form: KeyForm | None,
    fmt: ConvertFormat,
    part_keys: Mapping[str, str] | None,
    check_crc: bool,
    progress: Progress | None,
    start: float,
) -> ConvertResult:
    kind = _source_kind(src_path)
    if check_crc and kind is _Source.PT:
        verify_zip(src_path)
    elif check_crc and kind is _Source.SHARDED:
        verify_source(src_path)  # every file's CRC-32 against the manifest
    source = repr(str(src_path))
    with untrusted(f"checkpoint {source}", "its structure"):  # the boundary: what the writers below read
        if kind is _Source.PT and fmt is ConvertFormat.PT:
            done = _pt_to_pt(src_path, dst_path, form, part_keys, progress)
        elif kind is _Source.PT and fmt is ConvertFormat.SAFETENSORS:
            done = pt_to_safetensors(src_path, dst_path, form, part_keys)
        elif kind is _Source.PT and fmt is ConvertFormat.SHARDED:
            done = pt_to_sharded(src_path, dst_path, form, part_keys)
        elif kind is _Source.PT:
            done = pt_to_dcp(src_path, dst_path, form, part_keys)
        elif kind is _Source.SHARDED and fmt is ConvertFormat.PT:
            done = sharded_to_pt(src_path, dst_path, form)
        elif kind is _Source.SAFETENSORS and fmt is ConvertFormat.PT:
            done = safetensors_to_pt(src_path, dst_path, form, progress)
        elif kind is _Source.FOLDER and fmt is ConvertFormat.PT:
            done = parts_to_pt(read_foreign_folder(src_path, map_location="cpu"), dst_path, form, source)
        else:
            raise _unsupported(kind, fmt)
    return ConvertResult(
        src_path,
        dst_path,
        form,
        done.layout,
        done.prefix_before,
        done.prefix_after,
        done.model_keys,
        done.renamed_keys,
        done.param_names,
        done.bytes_written,
        time.perf_counter() - start,
        fmt,
    )


_E = TypeVar("_E", bound=enum.Enum)


def _as_enum(cls: type[_E], value: object, name: str) -> _E:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError as err:
        choices = ", ".join(repr(m.value) for m in cls)
        raise UsageError(f"{name}={value!r} is not one of {choices}", f"pass one of {choices}") from err


def _pt_to_pt(
    src: Path, dst: Path, to: KeyForm | None, part_keys: Mapping[str, str] | None, progress: Progress | None
) -> WriterReport:
    """Re-key the detected model entry and optimizer ``param_names`` in place; every other key stays."""
    contents = read_archive(src)
    parts = split_checkpoint(contents.obj, source=repr(str(src)), part_keys=part_keys)
    model = parts.model
    if not isinstance(model, MutableMapping):  # pragma: no cover - the unpickler only builds dicts
        raise KeyMismatchError(f"{str(src)!r}: the model state is {article(type(model).__name__)}, not a dict")
    before = prefix_style(model.keys())
    renamed = rekey_state_dict(model, to, repr(str(src))) if to is not None else 0
    names = rekey_param_names(parts.optimizer, to, repr(str(src))) if to is not None else 0
    contents.obj = plain_namespaces(contents.obj)
    new_pickle = dump_pickle(contents.obj, contents)

    def fill(fd: int, tmp: Path) -> int:
        written = rewrite_archive(contents, new_pickle, fd, progress)
        _check_output(tmp, contents.records[0].name, len(contents.records), new_pickle)
        return written

    written = write_locked(dst, fill)
    return WriterReport(parts.layout, before, prefix_style(model.keys()), len(model), renamed, names, written)


def _check_output(path: Path, first: str, count: int, new_pickle: bytes) -> None:
    """Read back the archive just written: its directory must list every record, its data.pkl must match."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        name = first.partition("/")[0] + "/data.pkl"
        if len(infos) != count or infos[0].filename != first or zf.read(name) != new_pickle:
            raise CheckpointWriteError("the converted archive did not read back as written; nothing was replaced")
