"""The live objects a checkpoint is saved from and restored into, named once.

:class:`TrainingObjects` is how a caller names them by keyword (``CheckpointManager(model=..., optimizer=...)``,
``mgr.save(step, model=...)``); :class:`LiveObjects` is the one value the save and restore paths carry, its data
position already found (:func:`~dist_resume._exact.data.stateful_data`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypedDict

import torch
from torch import nn

from .._core.errors import UsageError
from .._exact.data import data_sampler, stateful_data
from .moved import MIGRATION, moved_keyword

__all__ = ["TrainingObjects", "OBJECT_NAMES", "LiveObjects", "check_object_names", "data_position"]


class TrainingObjects(TypedDict, total=False):
    """The objects of a training run, by the keyword each is passed as (all optional).

    ``CheckpointManager(folder, **objects)`` registers them once; ``save``, ``save_async`` and ``resume`` take
    the same keywords, each replacing the registered object for that one call (``None`` included: not this
    time). ``sampler`` and ``dataloader`` name one data position: a ``ResumableDistributedSampler``, a
    ``DataLoader`` over one, or torchdata's ``StatefulDataLoader`` (both may be given when the loader's sampler is
    that sampler).
    """

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Any
    scaler: Any
    sampler: Any
    dataloader: Any
    ema: nn.Module | None


OBJECT_NAMES: Final = tuple(TrainingObjects.__annotations__)
_DATA: Final = ("sampler", "dataloader")  # two spellings of one data position


def check_object_names(objects: Mapping[str, Any], where: str) -> None:
    """Raise :class:`UsageError` at once for a keyword that names no training object."""
    unknown = [name for name in objects if name not in OBJECT_NAMES]
    moved = [said for name in unknown if (said := moved_keyword(name, objects[name], where)) is not None]
    if moved:
        raise UsageError(f"{'; '.join(moved)}; {MIGRATION}", hint=moved[0])
    if unknown:
        raise UsageError(
            f"{where} got unknown keyword(s) {', '.join(map(repr, unknown))}; the objects it takes are "
            + ", ".join(OBJECT_NAMES),
            hint="resume options (strict, allow_missing, rng, ...) go in options=dist_resume.ResumeOptions(...)",
        )


def data_position(objects: Mapping[str, Any], *, saving: bool, where: str) -> Any:
    """The holder of the data position among ``objects`` (``sampler`` / ``dataloader``), checked with the names.

    Raises :class:`UsageError` for an unknown keyword, a model that is no ``nn.Module``, a ``dataloader`` with
    no resumable sampler, or a ``sampler`` that is not the ``dataloader``'s.
    """
    check_object_names(objects, where)
    model = objects.get("model")
    if model is not None and not isinstance(model, nn.Module):
        raise UsageError(f"{where}: model= is {type(model).__name__}, not a torch.nn.Module")
    sampler, loader = objects.get("sampler"), objects.get("dataloader")
    data = stateful_data(loader, saving=saving)
    if sampler is not None and loader is not None and data_sampler(data) is not sampler:
        raise UsageError(
            f"{where} got sampler= ({type(sampler).__name__}) and dataloader= whose sampler is another object "
            f"({type(data).__name__}); a checkpoint saves one data position",
            hint="pass the DataLoader alone (its sampler is found), or the sampler alone",
        )
    return stateful_data(sampler, saving=saving) if data is None else data


@dataclass(frozen=True, slots=True)
class LiveObjects:
    """The model and what else a checkpoint saves or restores; ``data`` holds the data position (a sampler)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any = None
    scaler: Any = None
    data: Any = None
    ema: nn.Module | None = None

    @classmethod
    def named(
        cls, objects: Mapping[str, Any], *, saving: bool, where: str, registered: Mapping[str, Any] | None = None
    ) -> LiveObjects:
        """The objects given by keyword (:class:`TrainingObjects`), in place of the ``registered`` ones where given
        (a data position given, ``sampler`` or ``dataloader``, replaces both), checked: known names, a model, one
        data position."""
        if registered:
            data_given = any(k in objects for k in _DATA)
            objects = {**{k: v for k, v in registered.items() if not (data_given and k in _DATA)}, **objects}
        data = data_position(objects, saving=saving, where=where)
        model = objects.get("model")
        if model is None:
            raise UsageError(
                f"{where} has no model: none was registered and none was passed",
                hint="register it once, CheckpointManager(folder, model=model, ...), or pass model= to this call",
            )
        return cls(
            model, objects.get("optimizer"), objects.get("scheduler"), objects.get("scaler"), data, objects.get("ema")
        )

    def passed(self) -> dict[str, Any]:
        """``{part: object}`` for each optional part given (checkpoint part names: the data position is ``sampler``)."""
        parts = {
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "sampler": self.data,
            "ema": self.ema,
        }
        return {part: obj for part, obj in parts.items() if obj is not None}
