"""HF Trainer ``checkpoint-N/`` and Accelerate ``save_state`` folders read into :class:`CheckpointParts`.

Files that only an unsafe unpickler can read and that ``resume`` does not need (``rng_state*.pth``,
``training_args.bin``, ``random_states_*.pkl``) are never opened; their names are listed in
``meta["skipped_files"]``. :mod:`.folders` recognises the folders and dispatches here.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final

from .._core.bounds import MAX_INT64, count_problem
from .._core.errors import CheckpointCorruptError, CheckpointNotFoundError, NotACheckpointError
from .._core.text import preview
from .._core.untrusted import untrusted
from .._format.load import load_torch_file
from .._format.safe_open import open_checkpoint_file
from .._layout.layout import CheckpointParts, Layout, is_state_dict
from .safetensors_read import read_safetensors

__all__ = ["read_model_weights", "trainer_progress", "read_hf", "read_accelerate"]

_SAFE_WEIGHTS: Final = "model.safetensors"
_BIN_WEIGHTS: Final = "pytorch_model.bin"
_INDEX_SUFFIX: Final = ".index.json"
_HF_STATE: Final = "trainer_state.json"
_NEVER_OPENED: Final = re.compile(r"^rng_state.*\.pth$|^training_args\.bin$|^random_states_\d+\.pkl$|^.*\.pkl$")
_HF_STEP_DIR: Final = re.compile(r"^checkpoint-(\d+)$")


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir() if p.is_file()}


def has_weights(names: set[str]) -> bool:
    """Whether a folder with files ``names`` holds model weights in HF naming (one file or a sharded index)."""
    return bool({_SAFE_WEIGHTS, _BIN_WEIGHTS, _SAFE_WEIGHTS + _INDEX_SUFFIX, _BIN_WEIGHTS + _INDEX_SUFFIX} & names)


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
        with open_checkpoint_file(path) as f:
            return json.loads(f.read().decode("utf-8"))
    except CheckpointNotFoundError:
        raise  # removed meanwhile: not damage
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:  # ValueError: an int of 4,300+ digits
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
        with untrusted(f"checkpoint {str(folder)!r}", _HF_STATE):
            step, epoch, epoch_float = _progress(state)
    if step is None and (match := _HF_STEP_DIR.match(folder.name)):
        step = int(match.group(1))
    return step, epoch, epoch_float


def _progress(state: Any) -> tuple[int | None, int | None, float | None]:
    if not isinstance(state, Mapping):
        return None, None, None
    step, epoch, epoch_float = _count(state.get("global_step")), None, None
    raw_epoch = state.get("epoch")
    # bounded before float(): JSON's ints are unbounded, and float() of one past 1e308 raises OverflowError
    if (whole := _count(raw_epoch)) is not None:
        epoch, epoch_float = whole, float(whole)
    elif type(raw_epoch) is float and 0 <= raw_epoch <= MAX_INT64:  # NaN compares False
        epoch, epoch_float = math.floor(raw_epoch), raw_epoch
    return step, epoch, epoch_float


def _count(value: Any) -> int | None:
    """``value`` when it is an int from 0 to 2**63-1 (JSON's integers are unbounded), else None."""
    return value if count_problem(value) is None else None


def read_hf(folder: Path, opts: dict[str, Any]) -> CheckpointParts:
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


def read_accelerate(folder: Path, opts: dict[str, Any]) -> CheckpointParts:
    names = _names(folder)
    meta = _base_meta(folder, names, Layout.ACCELERATE)
    if not has_weights(names) and any(p.name.startswith("pytorch_model_fsdp") for p in folder.iterdir()):
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
