"""Checkpoint folders other tools write: HF Trainer ``checkpoint-N/``, Accelerate ``save_state``, DCP.

``detect_folder`` recognises a folder by its files; ``read_foreign_folder`` reads it into the same
:class:`CheckpointParts` a single file yields. Files that only an unsafe unpickler can read and that
``resume`` does not need (``rng_state*.pth``, ``training_args.bin``, ``random_states_*.pkl``) are never
opened; their names are listed in ``meta["skipped_files"]``.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .._core.errors import CheckpointCorruptError, NotACheckpointError
from .._core.text import preview
from .._core.types import MapLocation, PathLike
from .._format.load import load_torch_file
from .._layout.layout import CheckpointParts, Layout, is_state_dict
from .safetensors_read import SAFETENSORS_SUFFIX, is_safetensors, read_safetensors

__all__ = [
    "FolderKind",
    "FOLDER_LAYOUTS",
    "detect_folder",
    "read_foreign_folder",
    "read_model_weights",
    "unrecognised_folder",
    "is_manager_folder",
    "trainer_progress",
    "foreign_kind",
    "checkpoint_subfolders",
]


FolderKind = Layout  # the folder kinds are Layout.HF_TRAINER, Layout.ACCELERATE and Layout.DCP
FOLDER_LAYOUTS: Final = (Layout.HF_TRAINER, Layout.ACCELERATE, Layout.DCP)


# a CheckpointManager folder (dist_resume's own; _source.listing.CHECKPOINT_NAME plus its temps)
_OWN_FOLDER: Final = re.compile(r"^\.?ckpt_\d+\.pt(\.[0-9a-f]{16}\.tmp)?$")
_SAFE_WEIGHTS: Final = "model.safetensors"
_BIN_WEIGHTS: Final = "pytorch_model.bin"
_INDEX_SUFFIX: Final = ".index.json"
_HF_STATE: Final = "trainer_state.json"
_HF_FILES: Final = {"optimizer.pt", "scheduler.pt", _HF_STATE}
_ACCELERATE_FILES: Final = re.compile(r"^(optimizer|scheduler|sampler)(_\d+)?\.bin$|^random_states_\d+\.pkl$")
_NEVER_OPENED: Final = re.compile(r"^rng_state.*\.pth$|^training_args\.bin$|^random_states_\d+\.pkl$|^.*\.pkl$")
_HF_STEP_DIR: Final = re.compile(r"^checkpoint-(\d+)$")


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def _has_weights(names: set[str]) -> bool:
    return bool({_SAFE_WEIGHTS, _BIN_WEIGHTS, _SAFE_WEIGHTS + _INDEX_SUFFIX, _BIN_WEIGHTS + _INDEX_SUFFIX} & names)


def is_manager_folder(path: PathLike) -> bool:
    """True when ``path`` is a folder holding ``CheckpointManager`` files (``ckpt_<step>.pt``). Local."""
    folder = Path(path)
    return folder.is_dir() and any(_OWN_FOLDER.match(n) for n in _names(folder))


def detect_folder(path: PathLike) -> Layout | None:
    """The kind of foreign checkpoint folder ``path`` is, or ``None`` (not a folder, unknown, or dist_resume's own).

    Local. A ``CheckpointManager`` folder (``ckpt_<step>.pt`` files) always yields ``None``, so the
    caller's own handling keeps priority.
    """
    folder = Path(path)
    if not folder.is_dir():
        return None
    names = _names(folder)
    if any(_OWN_FOLDER.match(n) for n in names):
        return None
    if ".metadata" in names and any(n.endswith(".distcp") for n in names):
        return Layout.DCP
    if any(_ACCELERATE_FILES.match(n) for n in names):
        return Layout.ACCELERATE
    if _HF_FILES & names or _has_weights(names):
        return Layout.HF_TRAINER
    return None


def foreign_kind(path: PathLike) -> Layout | None:
    """The foreign layout ``path`` is (an HF Trainer, Accelerate or DCP folder, a ``.safetensors`` file), or None.

    Local; reads a folder's listing or a file's first bytes. A ``CheckpointManager`` folder, a torch
    file and anything unrecognised yield None.
    """
    p = Path(path)
    if p.is_dir():
        return detect_folder(p)
    if p.is_file() and (p.suffix == SAFETENSORS_SUFFIX or is_safetensors(p)):
        return Layout.SAFETENSORS
    return None


def read_foreign_folder(
    path: PathLike,
    layout: Layout | None = None,
    *,
    map_location: MapLocation = None,
    mmap: bool = True,
    weights_only: bool = True,
) -> CheckpointParts:
    """Read a foreign checkpoint folder of ``layout`` (None: detect it) into :class:`CheckpointParts`. Local.

    Raises :class:`NotACheckpointError` naming the files found and the folder kinds known for anything else.

    Example::

        >>> parts = read_foreign_folder("out/checkpoint-500", map_location="cpu")
        >>> parts.step, sorted(parts.model)[:1]
        (500, ['bert.embeddings.LayerNorm.bias'])
    """
    folder = Path(path)
    kind = detect_folder(folder) if layout is None else layout
    opts: dict[str, Any] = {"map_location": map_location, "mmap": mmap, "weights_only": weights_only}
    if kind is Layout.HF_TRAINER:
        return _read_hf(folder, opts)
    if kind is Layout.ACCELERATE:
        return _read_accelerate(folder, opts)
    if kind is Layout.DCP:
        from .dcp import read_dcp  # torch.distributed.checkpoint costs ~1 s to import

        return read_dcp(folder, map_location=map_location, weights_only=weights_only)
    raise unrecognised_folder(folder)


def checkpoint_subfolders(folder: Path) -> list[Path]:
    """The folders directly inside ``folder`` that are checkpoints (foreign or ``CheckpointManager``), oldest first.

    Local. An HF Trainer ``output_dir`` holds ``checkpoint-N/`` folders: they sort by N.
    """
    if not folder.is_dir():
        return []
    subs = [p for p in folder.iterdir() if p.is_dir() and (detect_folder(p) is not None or is_manager_folder(p))]
    return sorted(subs, key=lambda p: (int(m.group(1)) if (m := _HF_STEP_DIR.match(p.name)) else -1, p.name))


def unrecognised_folder(folder: Path) -> NotACheckpointError:
    """The error for a folder no reader recognises: what it holds, and which folders dist_resume reads. Local.

    A folder that holds checkpoint folders one level down (an HF Trainer ``output_dir``) says so and
    names the newest: resuming from the parent is a wrong path, never "nothing to resume".
    """
    subs = checkpoint_subfolders(folder)
    if subs:
        return NotACheckpointError(
            f"{str(folder)!r} is not a checkpoint itself but holds {len(subs)} checkpoint folder(s) one level down: "
            f"{preview((p.name + '/' for p in subs), 8)}; pass one of them, e.g. the newest: {str(subs[-1])!r}"
        )
    found = sorted(_names(folder)) if folder.is_dir() else []
    return NotACheckpointError(
        f"{str(folder)!r} is not a checkpoint folder dist_resume recognises (files: "
        f"{preview(found, 8) if found else 'none'}); known folders: a CheckpointManager folder (ckpt_<step>.pt), "
        f"{Layout.HF_TRAINER.value!r} (an HF Trainer checkpoint-N/: model.safetensors or pytorch_model.bin, "
        f"optimizer.pt, trainer_state.json), {Layout.ACCELERATE.value!r} (an Accelerate save_state folder: "
        f"model.safetensors, optimizer.bin) and {Layout.DCP.value!r} (a DCP folder "
        "written by torch.distributed.checkpoint: .metadata, *.distcp); a single checkpoint file (.pt, .pth, .ckpt, .bin, .safetensors) is read as well"
    )


def _load(folder: Path, name: str, opts: dict[str, Any]) -> Any:
    return load_torch_file(folder / name, **opts)


def read_model_weights(folder: Path, stem: str = "model", opts: dict[str, Any] | None = None) -> dict[str, Any]:
    """Model weights in HF naming: ``<stem>.safetensors``, ``pytorch_<stem>.bin`` or a sharded index of either. Local."""
    opts = opts or {"map_location": "cpu", "mmap": True, "weights_only": True}
    names = _names(folder)
    safe, binary = f"{stem}.safetensors", f"pytorch_{stem}.bin"
    if safe in names:
        return _read_safe(folder / safe, opts)
    if binary in names:
        return _as_state_dict(_load(folder, binary, opts), folder / binary)
    for index in (safe + _INDEX_SUFFIX, binary + _INDEX_SUFFIX):
        if index in names:
            return _read_sharded(folder, index, opts)
    raise NotACheckpointError(
        f"{str(folder)!r} has no model weights ({safe}, {binary} or a sharded *.index.json); "
        f"files: {preview(sorted(names), 8)}"
    )


def _read_safe(path: Path, opts: dict[str, Any]) -> dict[str, Any]:
    return read_safetensors(path, map_location=opts["map_location"], mmap=opts["mmap"])[0]


def _as_state_dict(obj: Any, path: Path) -> dict[str, Any]:
    if not is_state_dict(obj):
        raise NotACheckpointError(f"{str(path)!r} does not hold a state dict (found {type(obj).__name__})")
    return dict(obj)


def _read_sharded(folder: Path, index_name: str, opts: dict[str, Any]) -> dict[str, Any]:
    index = _read_json(folder / index_name)
    weight_map = index.get("weight_map") if isinstance(index, Mapping) else None
    if not isinstance(weight_map, Mapping) or not weight_map:
        raise CheckpointCorruptError(f"{str(folder / index_name)!r} has no 'weight_map'; re-save the model")
    odd = [f"{k!r}: {v!r}" for k, v in weight_map.items() if not (isinstance(k, str) and isinstance(v, str))]
    if odd:  # JSON keys are strings; a damaged file can map a key to a number, list or object
        raise CheckpointCorruptError(
            f"{str(folder / index_name)!r} maps tensors to things that are not shard file names: "
            f"{preview(odd)}; copy the whole checkpoint folder"
        )
    shards = sorted(set(weight_map.values()))
    bad = [s for s in shards if not isinstance(s, str) or Path(s).name != s or s in ("", ".", "..")]
    missing = [s for s in shards if s not in bad and not (folder / s).is_file()]
    if bad or missing:
        raise CheckpointCorruptError(
            f"{str(folder / index_name)!r} names shards that are not files of the folder: "
            f"{preview(bad + missing)}; copy the whole checkpoint folder"
        )
    merged: dict[str, Any] = {}
    for shard in shards:
        part = (
            _read_safe(folder / shard, opts)
            if shard.endswith(".safetensors")
            else _as_state_dict(_load(folder, shard, opts), folder / shard)
        )
        merged.update(part)
    absent = [k for k in weight_map if k not in merged]
    if absent:
        raise CheckpointCorruptError(
            f"{str(folder / index_name)!r} lists tensors no shard holds: {preview(absent)}; copy the whole folder"
        )
    return {k: merged[k] for k in weight_map}


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointCorruptError(f"cannot read {str(path)!r} as JSON ({err}); the file is damaged") from err


def _base_meta(folder: Path, names: set[str], kind: Layout) -> dict[str, Any]:
    skipped = sorted(n for n in names if _NEVER_OPENED.match(n))
    return {"source_layout": kind.value, "files": sorted(names), "skipped_files": skipped}


def trainer_progress(folder: Path) -> tuple[int | None, int | None, float | None]:
    """``(step, epoch, epoch as HF counts it)`` of an HF Trainer folder, from ``trainer_state.json``. Local.

    ``step`` is ``global_step`` (else the ``checkpoint-N`` folder name's N); ``epoch`` the whole epochs
    (HF counts fractional ones: 1.5 is half-way through epoch 1).
    """
    step = epoch = epoch_float = None
    if (folder / _HF_STATE).is_file():
        state = _read_json(folder / _HF_STATE)
        if isinstance(state, Mapping):
            step = state.get("global_step") if type(state.get("global_step")) is int else None
            raw_epoch = state.get("epoch")
            if isinstance(raw_epoch, (int, float)) and not isinstance(raw_epoch, bool) and math.isfinite(raw_epoch):
                epoch, epoch_float = math.floor(raw_epoch), float(raw_epoch)
    if step is None and (match := _HF_STEP_DIR.match(folder.name)):
        step = int(match.group(1))
    return step, epoch, epoch_float


def _read_hf(folder: Path, opts: dict[str, Any]) -> CheckpointParts:
    names = _names(folder)
    meta = _base_meta(folder, names, Layout.HF_TRAINER)
    model = read_model_weights(folder, "model", opts)
    parts: dict[str, Any] = {}
    for part, name in (("optimizer", "optimizer.pt"), ("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
        if name in names:
            parts[part] = _load(folder, name, opts)
    step, epoch, epoch_float = trainer_progress(folder)
    if epoch_float is not None:
        meta["epoch_float"] = epoch_float
    meta["step"], meta["epoch"] = step, epoch
    return CheckpointParts(layout=Layout.HF_TRAINER, model=model, step=step, epoch=epoch, meta=meta, **parts)


def _numbered(names: set[str], stem: str, suffix: str) -> list[str]:
    pattern = re.compile(rf"^{re.escape(stem)}_(\d+){re.escape(suffix)}$")
    return sorted((n for n in names if pattern.match(n)), key=lambda n: int(pattern.match(n).group(1)))  # type: ignore[union-attr]


def _read_accelerate(folder: Path, opts: dict[str, Any]) -> CheckpointParts:
    names = _names(folder)
    meta = _base_meta(folder, names, Layout.ACCELERATE)
    if not _has_weights(names) and any(p.name.startswith("pytorch_model_fsdp") for p in folder.iterdir()):
        raise NotACheckpointError(
            f"{str(folder)!r} holds FSDP-sharded Accelerate state (pytorch_model_fsdp_*); dist_resume reads "
            "full state dicts only: save with StateDictType.FULL_STATE_DICT, or convert it with "
            "accelerate merge-weights"
        )
    model = read_model_weights(folder, "model", opts)
    parts: dict[str, Any] = {}
    for part, name in (("optimizer", "optimizer.bin"), ("scheduler", "scheduler.bin"), ("scaler", "scaler.pt")):
        if name in names:
            parts[part] = _load(folder, name, opts)
    more = {
        "more_models": _numbered(names, "model", ".safetensors") + _numbered(names, "pytorch_model", ".bin"),
        "more_optimizers": _numbered(names, "optimizer", ".bin"),
        "more_schedulers": _numbered(names, "scheduler", ".bin"),
    }
    meta.update({k: v for k, v in more.items() if v})
    meta["not_read"] = sorted(n for n in names if n.startswith("sampler") or n.startswith("custom_checkpoint"))
    return CheckpointParts(layout=Layout.ACCELERATE, model=model, meta=meta, **parts)
