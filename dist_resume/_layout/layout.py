"""Checkpoint layouts: this toolkit's file format, and the foreign layouts people commonly save."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from .._core.errors import NotACheckpointError
from .._core.tensor_kind import refuse_odd_tensors
from .._core.text import article, preview
from .._core.untrusted import untrusted
from .detect import detect_parts, overrides
from .kinds import as_int, is_state_dict
from .meta import FORMAT_NAME, FORMAT_VERSION, Key, is_toolkit, toolkit_meta

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Key",
    "Layout",
    "CheckpointParts",
    "split_checkpoint",
    "is_state_dict",
    "describe_keys",
]


class Layout(enum.Enum):
    """How the objects are arranged in a checkpoint file."""

    TOOLKIT = "dist_resume"
    BARE = "bare state dict"
    MODEL_OPTIMIZER = "model+optimizer"
    STATE_DICT = "state_dict"
    MODEL_STATE_DICT = "model_state_dict"
    LIGHTNING = "lightning"
    DETECTED = "detected"
    HF_TRAINER = "hf-trainer"  # a transformers Trainer checkpoint-N/ folder
    ACCELERATE = "accelerate"  # an Accelerate save_state folder
    DCP = "dcp"  # a torch.distributed.checkpoint folder
    SAFETENSORS = "safetensors"  # a single .safetensors file: model weights only
    SHARDED = "dist_resume-sharded"  # dist_resume's sharded folder (an FSDP2 save): DCP files + train state + manifest


@dataclass(frozen=True)
class CheckpointParts:
    """A checkpoint split into the pieces ``resume`` restores."""

    layout: Layout
    model: Mapping[str, Any]
    optimizer: Any = None
    scheduler: Any = None
    scaler: Any = None
    step: int | None = None
    epoch: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    extra: Any = None
    rng: Any = None
    sampler: Any = None
    ema: Any = None
    keys: Mapping[str, str] = field(default_factory=dict)  # part -> the key it came from ("state.model")

    def describe_keys(self) -> str:
        """Which key each part came from: ``model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'``."""
        return describe_keys(self.keys)


_CONVENTIONAL_MODEL: Final = {
    "model_state_dict": Layout.MODEL_STATE_DICT,
    "model": Layout.MODEL_OPTIMIZER,
    "state_dict": Layout.STATE_DICT,
}
_LIGHTNING_MARKS: Final = ("pytorch-lightning_version", "optimizer_states", "lr_schedulers", "global_step")


def describe_keys(keys: Mapping[str, str]) -> str:
    """Which key each part came from: ``model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'``."""
    return ", ".join(f"{part} <- {key!r}" for part, key in keys.items())


def _is_lightning(obj: Mapping[str, Any]) -> bool:
    return is_state_dict(obj.get("state_dict")) and any(k in obj for k in _LIGHTNING_MARKS)


def _toolkit(obj: Mapping[str, Any], source: str, part_keys: Mapping[str, str] | None) -> CheckpointParts:
    meta = toolkit_meta(obj, source)
    model = obj.get(Key.MODEL)
    if not isinstance(model, Mapping):
        raise NotACheckpointError(f"{source} is marked as a dist_resume checkpoint but has no model state")
    if odd := [k for k in model if not isinstance(k, str)]:
        raise NotACheckpointError(
            f"{source} is marked as a dist_resume checkpoint but its model state has keys that are not strings "
            f"({preview(map(repr, odd), quote=False)}): the file is damaged or was edited; resume from another "
            "checkpoint"
        )
    parts = CheckpointParts(
        Layout.TOOLKIT,
        obj[Key.MODEL],
        obj.get(Key.OPTIMIZER),
        obj.get(Key.SCHEDULER),
        obj.get(Key.SCALER),
        as_int(meta.get("step")),
        as_int(meta.get("epoch")),
        meta,
        obj.get(Key.EXTRA),
        obj.get(Key.RNG),
        obj.get(Key.SAMPLER),
        obj.get(Key.EMA),
        {part: part for part in (Key.MODEL, Key.OPTIMIZER, Key.SCHEDULER, Key.SCALER, Key.EMA) if part in obj},
    )
    if not part_keys:
        return parts
    return replace(parts, **overrides(obj, part_keys, source), keys={**parts.keys, **part_keys})


def split_checkpoint(
    obj: Any,
    source: str = "checkpoint",
    *,
    model_keys: Collection[str] | None = None,
    part_keys: Mapping[str, str] | None = None,
    wanted: Collection[str] | None = None,
) -> CheckpointParts:
    """Recognise the layout of a loaded checkpoint and split it into its parts. Local.

    This toolkit's files and a bare state dict are read as such; any other dict is searched by
    name and content (see :mod:`dist_resume._layout.detect`): ``model_keys`` (the live model's
    state dict keys) pick the entry that fits the model when several could; ``part_keys`` (e.g.
    ``{"model": "MODEL_STATE"}``, ``"state.model"`` one level down) overrides detection for the
    parts it names; ``wanted`` (the parts the caller restores; default all) lets a part outside it
    that two entries could each be stay unread rather than refused. Works on tensors read without
    data (meta).

    Raises :class:`NotACheckpointError` naming the keys when no model is found, when two entries
    could each be the same part, or when a key in ``part_keys`` is absent; for this toolkit's files also when
    its metadata is not what ``save_checkpoint`` writes (:func:`~dist_resume._layout.meta.toolkit_meta`); and
    when a tensor of a part read (``wanted``; in this toolkit's file without ``wanted``: of any entry) but the model
    is not dense (sparse, nested, quantized, expanded: :func:`~dist_resume._core.tensor_kind.refuse_odd_tensors`),
    judged from its kind before anything touches its elements. The model's tensors must be of the live model's own
    kinds: the model's check says so.

    Example::

        >>> parts = split_checkpoint({"MODEL_STATE": {"fc.weight": torch.ones(1)}, "EPOCHS_RUN": 3})
        >>> parts.layout.value, parts.epoch, parts.describe_keys()
        ('detected', 3, "model <- 'MODEL_STATE', epoch <- 'EPOCHS_RUN'")
    """
    with untrusted(source, "its layout"):  # the boundary: whatever the checks below did not foresee
        parts = _split(obj, source, model_keys, part_keys, wanted)
        refuse_odd_tensors(_kinds_checked(obj, parts, wanted), source)
        return parts


def _kinds_checked(obj: Any, parts: CheckpointParts, wanted: Collection[str] | None) -> dict[str, Any]:
    """What of ``obj`` must hold dense tensors only, by kind, before anything reads an element: each part read (all
    of them without ``wanted``) but the model, whose tensors must be of the live model's own kinds (a model check's);
    and in this toolkit's file, which ``save_checkpoint`` writes dense throughout, every other entry too."""
    if parts.layout is Layout.TOOLKIT and wanted is None:
        return {key: value for key, value in obj.items() if key != Key.MODEL}
    names = ("optimizer", "scheduler", "scaler", "rng", "sampler", "ema")
    return {name: getattr(parts, name) for name in names if wanted is None or name in wanted}


def _split(
    obj: Any,
    source: str,
    model_keys: Collection[str] | None,
    part_keys: Mapping[str, str] | None,
    wanted: Collection[str] | None,
) -> CheckpointParts:
    if is_toolkit(obj):
        return _toolkit(obj, source, part_keys)
    if is_state_dict(obj) and not part_keys:
        return CheckpointParts(Layout.BARE, obj)
    if not isinstance(obj, Mapping):
        raise NotACheckpointError(
            f"{source} holds {article(type(obj).__name__)}, not a state dict or a dict of them; "
            "save model.state_dict() (or a dict holding it) rather than the module itself"
        )
    found = detect_parts(obj, source, model_keys=model_keys, part_keys=part_keys, wanted=wanted)
    model_key = found.keys.get("model")
    if model_key is None:
        raise NotACheckpointError(
            f"{source} has no model state dict (a mapping of names to tensors) among its keys "
            f"({preview(map(str, obj), 8)}); dist_resume looks for 'model', 'state_dict', 'model_state_dict' "
            "or any entry holding tensors (one level down too); name it with part_keys={'model': '<key>'}, "
            "or pass the model's state dict yourself (adapt_state_dict + load_state_dict)"
        )
    if model_key == "state_dict" and _is_lightning(obj):
        layout = Layout.LIGHTNING
    else:
        layout = _CONVENTIONAL_MODEL.get(model_key, Layout.DETECTED)
    v = found.values
    return CheckpointParts(
        layout,
        v["model"],
        v.get("optimizer"),
        v.get("scheduler"),
        v.get("scaler"),
        step=v.get("step"),
        epoch=v.get("epoch"),
        extra=found.extra,
        rng=v.get("rng"),
        sampler=v.get("sampler"),
        ema=v.get("ema"),
        keys=found.keys,
    )
