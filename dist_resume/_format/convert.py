"""Converting a checkpoint between single-process and DDP key forms without deserializing its tensors."""

from __future__ import annotations

import enum
import fcntl
import glob
import os
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._core.errors import CheckpointWriteError, KeyMismatchError, UsageError
from .._core.text import article
from .._core.types import PathLike
from .._state.prefix import DDP_PREFIX, canonical_key, prefix_style
from .archive import read_archive, verify_archive
from .archive_write import dump_pickle, rewrite_archive
from .atomic import TEMP_NAME, atomic_write
from .layout import Layout, split_checkpoint

__all__ = ["KeyForm", "ConvertResult", "convert_checkpoint", "target_key", "remove_stale_temps"]


class KeyForm(enum.Enum):
    """The key form to convert to: what ``model.state_dict()`` gives for a plain model, or for DDP around it."""

    SINGLE = "single"
    DDP = "ddp"


@dataclass(frozen=True)
class ConvertResult:
    """What :func:`convert_checkpoint` did."""

    src: Path
    dst: Path
    to: KeyForm
    layout: Layout
    prefix_before: str
    prefix_after: str
    model_keys: int
    renamed_keys: int
    param_names: int
    bytes_written: int
    seconds: float


def target_key(key: str, to: KeyForm) -> str:
    """``key`` in the target form: canonical (no ``module.``/``_orig_mod.``), plus ``module.`` for DDP."""
    inner = canonical_key(key)
    return DDP_PREFIX + inner if to is KeyForm.DDP else inner


def _module_path(path: str, to: KeyForm) -> str:
    """A ``_metadata`` module path (``''`` is the root) in the target form."""
    inner = target_key(path + "._", KeyForm.SINGLE)[:-2] if path else ""
    if to is KeyForm.SINGLE:
        return inner
    return DDP_PREFIX[:-1] + ("." + inner if inner else "")


def _convert_metadata(meta: MutableMapping[str, Any], to: KeyForm) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict()
    if to is KeyForm.DDP:
        out[""] = {"version": 1}  # the wrapper's own entry, as add_prefix writes it
    depth: dict[str, int] = {}
    for name, value in meta.items():
        new = _module_path(name, to)
        if new in depth and depth[new] > len(name):
            continue  # a wrapper's entry and its inner module's map to one path: keep the inner module's
        out[new], depth[new] = value, len(name)
    return out


def _convert_state_dict(state_dict: MutableMapping[str, Any], to: KeyForm, source: str) -> int:
    """Re-key ``state_dict`` in place (it is the object inside the checkpoint); return how many keys changed."""
    items = list(state_dict.items())
    new_keys = [target_key(k, to) for k, _ in items]
    if len(set(new_keys)) != len(new_keys):
        seen: dict[str, str] = {}
        clashes = []
        for (old, _), new in zip(items, new_keys):
            if new in seen:
                clashes.append(f"{seen[new]!r} and {old!r}")
            seen.setdefault(new, old)
        raise KeyMismatchError(
            f"{source}: model keys collide after conversion ({'; '.join(clashes[:3])}"
            f"{' ...' if len(clashes) > 3 else ''}): the state dict mixes wrapped and unwrapped copies of the same "
            "parameters; remove the duplicates first"
        )
    meta = getattr(state_dict, "_metadata", None)
    state_dict.clear()
    state_dict.update(zip(new_keys, (v for _, v in items)))
    if meta is not None:
        state_dict._metadata = _convert_metadata(meta, to)  # type: ignore[attr-defined]
    return sum(old != new for (old, _), new in zip(items, new_keys))


def _convert_param_names(optimizer: Any, to: KeyForm) -> int:
    if not isinstance(optimizer, MutableMapping):
        return 0
    count = 0
    for group in optimizer.get("param_groups") or ():
        names = group.get("param_names") if isinstance(group, MutableMapping) else None
        if isinstance(names, list) and all(isinstance(n, str) for n in names):
            group["param_names"] = [target_key(n, to) for n in names]
            count += len(names)
    return count


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    same = src.resolve() == dst.resolve() or (dst.exists() and src.exists() and os.path.samefile(src, dst))
    if same:
        raise UsageError(
            f"SRC and DST are the same file ({str(src)!r})",
            "write to a new file, then replace the old one yourself once you have checked it",
        )
    if dst.is_dir():
        raise UsageError(f"DST {str(dst)!r} is a folder", "give the output file's full name, e.g. DST/model.pt")
    if dst.exists() and not force:
        raise UsageError(f"DST {str(dst)!r} already exists", "pass --force to replace it")


def _temps(dst: Path) -> Iterator[Path]:
    """The temporary files atomic_write may have left for ``dst`` (``.<name>.<16 hex>.tmp``)."""
    for tmp in dst.parent.glob(f".{glob.escape(dst.name)}.*.tmp"):
        match = TEMP_NAME.match(tmp.name)
        if match and match.group("dest") == dst.name:
            yield tmp


def remove_stale_temps(dst: Path) -> list[Path]:
    """Delete temp files a killed conversion to ``dst`` left behind; return them.

    A live conversion holds an exclusive ``flock`` on its temp file for its whole life, and the
    kernel drops it when the process dies, even by SIGKILL: a temp file whose lock can be taken
    belongs to no one.
    """
    removed = []
    for tmp in _temps(dst):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # a conversion is writing it right now
        finally:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def convert_checkpoint(
    src: PathLike,
    dst: PathLike,
    to: KeyForm,
    *,
    force: bool = False,
    check_crc: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Write ``dst``: ``src`` with model keys and optimizer ``param_names`` in the ``to`` form.

    Local. Reads only ``src``'s data.pkl; tensor records are copied byte for byte. ``dst`` appears
    atomically (temp file in its folder, fsync, rename) or not at all.

    Example::

        >>> torch.save({"fc.weight": torch.ones(2, 2)}, "single.pt")
        >>> convert_checkpoint("single.pt", "ddp.pt", KeyForm.DDP).prefix_after
        'module.'
    """
    start = time.perf_counter()
    src_path, dst_path = Path(src), Path(dst)
    _check_paths(src_path, dst_path, force)
    if check_crc:
        verify_archive(src_path)
    contents = read_archive(src_path)
    parts = split_checkpoint(contents.obj, source=str(src_path))
    model = parts.model
    if not isinstance(model, MutableMapping):  # pragma: no cover - the unpickler only builds dicts
        raise KeyMismatchError(f"{str(src_path)!r}: the model state is {article(type(model).__name__)}, not a dict")
    before = prefix_style(model.keys())
    renamed = _convert_state_dict(model, to, str(src_path))
    names = _convert_param_names(parts.optimizer, to)
    new_pickle = dump_pickle(contents.obj, contents)
    written = 0

    def write(f: Any) -> None:
        nonlocal written
        fd = f.fileno()
        fcntl.flock(fd, fcntl.LOCK_EX)  # marks the temp file as live for remove_stale_temps
        written = rewrite_archive(contents, new_pickle, fd, progress)
        _check_output(_temp_path(dst_path, fd), contents.records[0].name, len(contents.records), new_pickle)

    if dst_path.parent.is_dir():
        remove_stale_temps(dst_path)
    atomic_write(dst_path, write)
    return ConvertResult(
        src_path,
        dst_path,
        to,
        parts.layout,
        before,
        prefix_style(model.keys()),
        len(model),
        renamed,
        names,
        written,
        time.perf_counter() - start,
    )


def _temp_path(dst: Path, fd: int) -> Path:
    st = os.fstat(fd)
    for tmp in _temps(dst):
        try:
            if os.path.samestat(tmp.stat(), st):
                return tmp
        except OSError:
            continue
    raise CheckpointWriteError(f"the temporary file for {str(dst)!r} disappeared while it was written")


def _check_output(path: Path, first: str, count: int, new_pickle: bytes) -> None:
    """Read back the archive just written: its directory must list every record, its data.pkl must match."""
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        name = first.partition("/")[0] + "/data.pkl"
        if len(infos) != count or infos[0].filename != first or zf.read(name) != new_pickle:
            raise CheckpointWriteError("the converted archive did not read back as written; nothing was replaced")
