"""The two runs' checkpoints for ``dist-resume check``: which ones to pair, and how a pair differs, part by part.

Each checkpoint is read as ``resume`` reads it (:func:`~dist_resume.cli._verify.read_parts`: the toolkit's numbered
files and sharded folders, HF Trainer / Accelerate / DCP folders, any single torch file split into its parts) and
compared as ``verify`` compares (:func:`~dist_resume.cli._compare.compare_parts`: model under canonical keys,
optimizer state and every group's hyperparameters, scheduler, scaler, step, epoch), plus what an exact resume also
needs equal: every rank's RNG streams, the data position, ``extra`` and the EMA, and the world size it was saved at.
Python's ``random`` and NumPy's global stream are a part of their own (:data:`UNSEEDED_PART`): a script that seeds
only torch leaves them to the OS's entropy, and the verdict tells that apart from a restore that went wrong.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ..._core.errors import UsageError
from ..._core.text import preview
from ..._foreign.folders import checkpoint_subfolders, foreign_kind
from ..._layout.layout import CheckpointParts
from ..._source.listing import numbered_checkpoints
from ..._state.optim.keys import NOT_HYPERPARAMETERS
from .._compare import Report, compare_parts, compare_values
from .._verify import read_parts
from ._mask import Masks, mask_parts
from ._result import HyperparameterDifference, PartDifference
from ._watch import SUFFIXES, step_of

__all__ = [
    "UNSEEDED_PART",
    "EXTRA_PART",
    "UNSEEDED_STREAMS",
    "unseeded_said",
    "Pair",
    "PairResult",
    "folder_checkpoints",
    "pairs_to_compare",
    "compare_pair",
    "extra_differences",
]

UNSEEDED_PART: Final = "rng (python, numpy)"
EXTRA_PART: Final = "extra"  # the script's own entries: a difference only with strict_extra (the verdict names them)
UNSEEDED_STREAMS: Final = {  # keys of each rank's RNG dict (rng_state_dict): the stream in words, how to seed it
    "python": ("Python's `random`", "random.seed(seed)"),
    "numpy": ("NumPy's global stream", "numpy.random.seed(seed)"),
}
_MORE_PARTS: Final = (("sampler", "data position"), ("extra", EXTRA_PART), ("ema", "ema"))
_EXTRA_DEPTH: Final = 4  # levels of extra followed to name a key that differs


def folder_checkpoints(folder: Path) -> list[tuple[int | None, Path]]:
    """(step, path) of the checkpoints a run left in ``folder``, oldest first: the toolkit's numbered ones, the
    checkpoint folders one level down (``checkpoint-N/``), the folder itself when it is one (an Accelerate or DCP
    folder), or its checkpoint files (one, or several with a step in their names); [] for none. Local."""
    numbered: list[tuple[int | None, Path]] = [(s, Path(p)) for s, p in numbered_checkpoints(folder)]  # a local run
    if numbered:
        return numbered
    subs = checkpoint_subfolders(folder)
    if subs:
        return [(step_of(p.name), Path(p)) for p in subs]
    if foreign_kind(folder) is not None:
        return [(None, folder)]
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SUFFIXES) and p.name[0] != ".")
    steps = [step_of(p.name) for p in files]
    if len(files) <= 1:  # none: the run wrote nothing (a relaunch that failed at once), said by the verdict
        return [(steps[0], files[0])] if files else []
    if None not in steps and len(set(steps)) == len(steps):
        return sorted(zip(steps, files), key=lambda item: item[0] or 0)
    held = preview(sorted(p.name for p in folder.iterdir()), 8)
    raise UsageError(
        f"the run left {held} in {str(folder)!r}: not one checkpoint, nor checkpoints with a step in their names",
        hint="{dir} must be the folder the command saves its checkpoints in: a CheckpointManager folder, an HF "
        "Trainer output_dir, one checkpoint file, or files named with their step (epoch_3.pt)",
    )


@dataclass(frozen=True)
class Pair:
    """The checkpoint of ``step`` in each run (None: the newest of each, whose names carry no step)."""

    step: int | None
    reference: Path
    interrupted: Path


def pairs_to_compare(reference: Path, interrupted: Path) -> list[Pair]:
    """Every step both folders hold, ascending, then the newest of each if that is not the last of them. Local."""
    ref, got = folder_checkpoints(reference), folder_checkpoints(interrupted)
    if not ref or not got:
        return []
    by_step = {step: path for step, path in got if step is not None}
    pairs = [Pair(step, path, by_step[step]) for step, path in ref if step is not None and step in by_step]
    newest = Pair(ref[-1][0] if ref[-1][0] == got[-1][0] else None, ref[-1][1], got[-1][1])
    if not pairs or (pairs[-1].reference, pairs[-1].interrupted) != (newest.reference, newest.interrupted):
        pairs.append(newest)
    return pairs


@dataclass(frozen=True)
class PairResult:
    """How one pair differs (``parts``, ``hyperparameters``) and what the diagnosis asks of it: which parts each
    checkpoint holds (``held``: part -> (reference has it, interrupted has it)), group 0's ``lr`` in each, and the
    world sizes they were saved at; ``rng`` and ``position``: each checkpoint's RNG streams and data position, as
    saved; ``masked``: where a saved string named the run's folder (:mod:`._mask`); ``meta``: each one's ``meta``;
    ``extra_keys``: the keys of ``extra`` that differ (:func:`extra_differences`)."""

    pair: Pair
    parts: tuple[PartDifference, ...]
    hyperparameters: tuple[HyperparameterDifference, ...]
    held: Mapping[str, tuple[bool, bool]]
    lr: tuple[Any, Any]
    world_size: tuple[Any, Any]
    streams: tuple[str, ...] = ()  # which of UNSEEDED_STREAMS differ (the keys of the UNSEEDED_PART difference)
    rng: tuple[Any, Any] = (None, None)
    position: tuple[Any, Any] = (None, None)
    masked: tuple[str, ...] = ()
    meta: tuple[Any, Any] = (None, None)  # each checkpoint's meta, as saved (the run's evidence: _save/evidence.py)
    extra_keys: tuple[str, ...] = ()  # where extra differs (extra_differences)

    @property
    def equal(self) -> bool:
        return not self.parts

    def differs(self, part: str) -> bool:
        return any(p.part == part for p in self.parts)


def _entries(value: Any) -> Mapping[Any, Any] | None:
    """What a saved value holds by key: a mapping's items, an ``argparse.Namespace``'s attributes (torchvision's and
    timm's ``args``); None for anything else."""
    if isinstance(value, Mapping):
        return value
    return vars(value) if isinstance(value, argparse.Namespace) else None


def extra_differences(a: Any, b: Any, *, path: str = "", depth: int = _EXTRA_DEPTH) -> list[str]:
    """Where two ``extra`` values differ, as key paths (``['args']['start_epoch']``; ``''`` for the whole value):
    every key one holds and the other does not, and every key whose values differ, followed into nested dicts (and
    Namespaces) ``depth`` levels deep. [] when equal. Local; never raises on what a checkpoint holds."""
    x, y = _entries(a), _entries(b)
    if x is None or y is None or depth == 0:
        return [] if compare_values(a, b) is None else [path]
    found = []
    for key in [*x, *(k for k in y if k not in x)]:
        here = f"{path}[{key!r}]"
        if key not in x or key not in y:
            found.append(here)
        else:
            found += extra_differences(x[key], y[key], path=here, depth=depth - 1)
    return found


def _group_lr(optimizer: Any) -> Any:
    groups = optimizer.get("param_groups") if isinstance(optimizer, Mapping) else None
    return groups[0].get("lr") if groups and isinstance(groups[0], Mapping) else None


def _hyperparameters(step: int | None, a: Any, b: Any) -> list[HyperparameterDifference]:
    ga = a.get("param_groups") if isinstance(a, Mapping) else None
    gb = b.get("param_groups") if isinstance(b, Mapping) else None
    found = []
    for i, (x, y) in enumerate(zip(ga or [], gb or [])):
        if not (isinstance(x, Mapping) and isinstance(y, Mapping)):
            continue
        for name in (k for k in x if k in y and k not in NOT_HYPERPARAMETERS):
            if compare_values(x[name], y[name]) is not None:
                found.append(HyperparameterDifference(step, i, str(name), x[name], y[name]))
    return found


def _world_size(parts: CheckpointParts) -> Any:
    size = parts.meta.get("world_size") if isinstance(parts.meta, Mapping) else None
    return size if size is not None else (len(parts.rng) if isinstance(parts.rng, list) else None)


def unseeded_said(streams: Iterable[str]) -> tuple[str, bool, str]:
    """How the unseeded ``streams`` (keys of :data:`UNSEEDED_STREAMS`) are said: their names, whether there is one
    (``differs`` / ``it``), and the calls that seed them."""
    named = set(streams)
    said = [words for name, words in UNSEEDED_STREAMS.items() if name in named] or list(UNSEEDED_STREAMS.values())
    return " and ".join(n for n, _ in said), len(said) == 1, " and ".join(h for _, h in said)


def _split_rng(rng: Any) -> tuple[Any, dict[str, list[Any]]]:
    """Each rank's RNG dict without ``python`` and ``numpy``, and those two as rank lists ({} when the RNG state is
    not a list of dicts, as a foreign checkpoint's)."""
    if not (isinstance(rng, list) and rng and all(isinstance(r, Mapping) for r in rng)):
        return rng, {}
    if not any(name in r for r in rng for name in UNSEEDED_STREAMS):
        return rng, {}
    rest = [{k: v for k, v in r.items() if k not in UNSEEDED_STREAMS} for r in rng]
    return rest, {name: [r.get(name) for r in rng] for name in UNSEEDED_STREAMS if any(name in r for r in rng)}


def _compare_rng(report: Report, x: Any, y: Any) -> tuple[str, ...]:
    """The RNG streams as two parts: "rng" (torch's, the accelerator's, the seed) and :data:`UNSEEDED_PART`, a
    difference keyed by the stream; returns the unseeded streams that differ."""
    if x is None or y is None:
        if (x is None) != (y is None):
            report.diff("rng", "-", f"only {'A' if y is None else 'B'} holds it")
        return ()
    (rest_x, own_x), (rest_y, own_y) = _split_rng(x), _split_rng(y)
    if set(own_x) != set(own_y) or (own_x and len(rest_x) != len(rest_y)):
        rest_x, rest_y, own_x, own_y = x, y, {}, {}  # shaped differently: one part, as any other
    problem = compare_values(rest_x, rest_y)
    if problem is not None:
        report.diff("rng", "-", problem)
    differ = []
    for name in own_x:
        problem = compare_values(own_x[name], own_y[name])
        if problem is not None:
            report.diff(UNSEEDED_PART, name, problem)
            differ.append(name)
    return tuple(differ)


def compare_pair(pair: Pair, masks: Masks = ()) -> PairResult:
    """Read both checkpoints of ``pair`` and compare them part by part, every saved string that names a folder of
    ``masks`` (:func:`~._mask.masks_for`: the runs' folders) with it replaced. Local."""
    (a, in_a), (b, in_b) = (mask_parts(read_parts(p), masks) for p in (pair.reference, pair.interrupted))
    report = compare_parts(a, b)
    for note in report.not_compared:  # "optimizer (only B has one)": a part one run saved and the other did not
        part, _, why = note.partition(" (")
        report.diff(part, "-", why.rstrip(")"))
    streams = _compare_rng(report, a.rng, b.rng)
    for name, label in _MORE_PARTS:
        x, y = getattr(a, name), getattr(b, name)
        problem = compare_values(x, y) if x is not None and y is not None else None
        if problem is not None:
            report.diff(label, "-", problem)
        elif (x is None) != (y is None):
            report.diff(label, "-", f"only {'A' if y is None else 'B'} holds it")
    sizes = (_world_size(a), _world_size(b))
    if None not in sizes and sizes[0] != sizes[1]:
        report.diff("world size", "-", f"A was saved at {sizes[0]}, B at {sizes[1]}")
    grouped: dict[str, list[dict[str, str]]] = {}
    for d in report.differences:
        grouped.setdefault(d["part"], []).append(d)
    parts = tuple(PartDifference(part, ds[0]["key"], ds[0]["problem"], len(ds)) for part, ds in grouped.items())
    held = {
        name: (getattr(a, name) is not None, getattr(b, name) is not None)
        for name in ("optimizer", "scheduler", "scaler", "rng", "sampler")
    }
    return PairResult(
        pair,
        parts,
        tuple(_hyperparameters(pair.step, a.optimizer, b.optimizer)),
        held,
        (_group_lr(a.optimizer), _group_lr(b.optimizer)),
        sizes,
        streams,
        (a.rng, b.rng),
        (a.sampler, b.sampler),
        tuple(dict.fromkeys((*in_a, *in_b))),
        (a.meta, b.meta),
        tuple(extra_differences(a.extra, b.extra)) if any(p.part == EXTRA_PART for p in parts) else (),
    )
