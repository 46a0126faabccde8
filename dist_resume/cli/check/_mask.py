"""The run's own folder in what it saved, for ``dist-resume check``: a script that saves its arguments (nanoGPT's
``config``, torchvision's and timm's ``args``) saves the folder the check gave it, another for each run. Before two
checkpoints are compared, every string anywhere in their parts that names a run's folder is compared with that part
replaced by :data:`RUN_FOLDER` (the check's temporary folder around both by :data:`CHECK_FOLDER`), and the keys where
that happened are said in the report. Local; only strings change, nothing else is copied.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from ..._layout.layout import CheckpointParts

__all__ = ["RUN_FOLDER", "CHECK_FOLDER", "Masks", "masks_for", "mask_parts", "masked_said"]

RUN_FOLDER: Final = "<run folder>"
CHECK_FOLDER: Final = "<check folder>"
_PARTS: Final = (  # CheckpointParts field -> the part's name in the report (as ._compare names them)
    ("model", "model"),
    ("optimizer", "optimizer"),
    ("scheduler", "scheduler"),
    ("scaler", "scaler"),
    ("meta", "meta"),
    ("extra", "extra"),
    ("sampler", "data position"),
    ("ema", "ema"),
)

Masks = tuple[tuple[str, str], ...]  # (text found, placeholder), longest text first


def masks_for(runs: Iterable[Path], root: Path | None = None) -> Masks:
    """What to replace: each run's folder (as given and resolved) by :data:`RUN_FOLDER`, then ``root`` (the check's
    temporary folder that holds them) by :data:`CHECK_FOLDER`; longest first, so a folder is replaced before the
    root that holds it."""
    found: dict[str, str] = {}
    for folder, placeholder in [*((run, RUN_FOLDER) for run in runs), *([(root, CHECK_FOLDER)] if root else [])]:
        for text in {str(folder), os.path.realpath(folder)}:
            if len(text) > 1:  # never "/" alone: every absolute path would hold it
                found.setdefault(text, placeholder)
    return tuple(sorted(found.items(), key=lambda item: -len(item[0])))


def _masked(text: str, masks: Masks) -> str:
    for found, placeholder in masks:
        text = text.replace(found, placeholder)
    return text


def _walk(value: Any, masks: Masks, key: str, changed: list[str]) -> Any:
    """``value`` with its strings masked; the same object where nothing changed. ``changed`` gets each key (marked
    with :data:`CHECK_FOLDER` where only the check's folder was named)."""
    if isinstance(value, str):
        new = _masked(value, masks)
        if new != value:
            changed.append(key if RUN_FOLDER in new else f"{CHECK_FOLDER}{key}")
        return new
    if isinstance(value, Mapping):
        items = {k: _walk(v, masks, f"{key}[{k!r}]", changed) for k, v in value.items()}
        return items if any(items[k] is not value[k] for k in items) else value
    if type(value) in (list, tuple):
        seq = [_walk(v, masks, f"{key}[{i}]", changed) for i, v in enumerate(value)]
        return type(value)(seq) if any(a is not b for a, b in zip(seq, value)) else value
    return value


def _named(part: str, key: str) -> str:
    root = key.startswith(CHECK_FOLDER)
    return f"{CHECK_FOLDER if root else ''}{part} {key.removeprefix(CHECK_FOLDER)}".rstrip()


def mask_parts(parts: CheckpointParts, masks: Masks) -> tuple[CheckpointParts, tuple[str, ...]]:
    """``parts`` with every string that names a folder of ``masks`` replaced, and where (``extra ['args']['out']``,
    the part's name and its key as the comparison says them; led by :data:`CHECK_FOLDER` where the string named the
    check's folder and no run's). Local."""
    if not masks:
        return parts, ()
    changed: list[str] = []
    new = {}
    for field, name in _PARTS:
        value = getattr(parts, field)
        before = len(changed)
        masked = _walk(value, masks, "", changed)
        changed[before:] = [_named(name, key) for key in changed[before:]]
        if masked is not value:
            new[field] = masked
    return (dataclasses.replace(parts, **new) if new else parts), tuple(changed)


def masked_said(keys: Sequence[str]) -> str:
    """The report's note on the strings masked (``keys``: distinct, as :func:`mask_parts` gives them)."""
    from ..._core.text import preview

    runs = [k for k in keys if not k.startswith(CHECK_FOLDER)]
    roots = [k.removeprefix(CHECK_FOLDER) for k in keys if k.startswith(CHECK_FOLDER)]
    said = []
    if runs:
        n = len(runs)
        said.append(
            f"{n} saved string{'s' if n != 1 else ''} named the run's folder ({preview(runs, 4, quote=False)}), "
            f"another in each run; compared with it replaced by {RUN_FOLDER}"
        )
    if roots:
        n = len(roots)
        said.append(
            f"{n} saved string{'s' if n != 1 else ''} named the check's temporary folder "
            f"({preview(roots, 4, quote=False)}); compared with it replaced by {CHECK_FOLDER}"
        )
    return "; ".join(said)
