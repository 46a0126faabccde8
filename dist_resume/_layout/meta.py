"""What marks a dist_resume checkpoint and what its metadata may hold: checked once, in one place, without torch.

``save_checkpoint`` writes ``{"format": "dist_resume", "format_version": 1, "meta": {...}, ...}`` (a sharded folder's
``train_state.pt`` carries the same three). Whether a loaded object is such a checkpoint, and whether its metadata is
what a save writes (each entry of its type and within its range), is decided by :func:`toolkit_meta`, which every
reader calls: the split of a loaded checkpoint (:func:`~dist_resume._layout.layout.split_checkpoint`), the verdict on
a folder's checkpoint (:func:`~dist_resume._source.integrity.inspect_checkpoint`: the manager's choice,
``latest_checkpoint`` and ``dist-resume list``), and ``list``'s torch-free path. So a file one of them refuses, every
one refuses, with the same words.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from .._core.bounds import count_problem, time_problem
from .._core.errors import NotACheckpointError
from .._core.text import article, described
from .._core.version import __version__

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "Key",
    "DDP_BUCKETS",
    "is_toolkit",
    "toolkit_meta",
    "meta_problem",
    "bucket_layout",
]

FORMAT_NAME: Final = "dist_resume"
# The layout save_checkpoint writes (its top-level keys and what each holds), 1 since 0.1. A reader refuses a newer
# one, as torch.load refuses a newer zip format: a change an older reader would read wrong raises it; a file without
# it is read as 1.
FORMAT_VERSION: Final = 1


class Key:
    """Top-level keys of a dist_resume checkpoint, defined once."""

    FORMAT: Final = "format"
    VERSION: Final = "format_version"
    MODEL: Final = "model"
    OPTIMIZER: Final = "optimizer"
    SCHEDULER: Final = "scheduler"
    SCALER: Final = "scaler"
    META: Final = "meta"
    EXTRA: Final = "extra"
    RNG: Final = "rng"
    SAMPLER: Final = "sampler"
    EMA: Final = "ema"


DDP_BUCKETS: Final = "ddp_buckets"
"""The ``meta`` entry of a DDP model's checkpoint that holds the bucket layout its DDP reduced in: a list of buckets,
each a list of parameter indices (:mod:`dist_resume._dist.ddp_buckets` writes and replays it)."""

_COUNTS: Final = {"step": 0, "epoch": 0, "world_size": 1}  # each an int from this to 2**63-1
_TEXTS: Final = ("torch_version", "dist_resume_version", "model_class", "optimizer_class")


def is_toolkit(obj: Any) -> bool:
    """Whether ``obj`` is marked as a dist_resume checkpoint (a mapping whose ``format`` is ``"dist_resume"``)."""
    if not isinstance(obj, Mapping):
        return False
    marker = obj.get(Key.FORMAT)
    return type(marker) is str and marker == FORMAT_NAME  # (not `==` alone: a damaged file's tensor compares as one)


def meta_problem(key: str, value: Any) -> str | None:
    """Why ``value`` is not what ``save_checkpoint`` writes under ``meta[key]``, or None (None is allowed for every
    entry; an entry save_checkpoint does not write is not checked). Local.

    Example::

        >>> meta_problem("step", -1), meta_problem("epoch", "1"), meta_problem("saved_at", 1.7e9)
        ('-1, not an int from 0 to 2**63-1', 'a str, not an int from 0 to 2**63-1', None)
    """
    if value is None:
        return None
    if key in _COUNTS:
        least = _COUNTS[key]
        if count_problem(value, least=least) is None:
            return None
        shown = described(value, 40) if type(value) is int else article(type(value).__name__)
        return f"{shown}, not an int from {least} to 2**63-1"
    if key in _TEXTS and not isinstance(value, str):
        return f"{article(type(value).__name__)}, not a str"
    if key == "saved_at" and time_problem(value) is not None:
        shown = described(value, 40) if type(value) in (int, float) else article(type(value).__name__)
        return f"{shown}, not a time in seconds"
    if key == DDP_BUCKETS:
        return _buckets_problem(value)
    return None


def _buckets_problem(value: Any) -> str | None:
    if type(value) is not list or not value:
        return f"{article(type(value).__name__)}, not a non-empty list of buckets"
    if any(type(bucket) is not list or not bucket for bucket in value):
        return "a list with a bucket that is not a non-empty list of parameter indices"
    indices = [i for bucket in value for i in bucket]
    if any(type(i) is not int for i in indices):
        return "a list of buckets with a parameter index that is not an int"
    if sorted(indices) != list(range(len(indices))):
        return f"a list of buckets whose {len(indices)} indices are not each parameter's index once"
    return None


def bucket_layout(meta: Mapping[str, Any]) -> tuple[tuple[int, ...], ...] | None:
    """``meta``'s DDP bucket layout (:data:`DDP_BUCKETS`) as a tuple of buckets, or None; ``meta`` is one
    :func:`toolkit_meta` returned, which checked it."""
    value = meta.get(DDP_BUCKETS)
    if value is None or _buckets_problem(value) is not None:
        return None
    return tuple(tuple(bucket) for bucket in value)


def toolkit_meta(obj: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The ``meta`` of ``obj``, a checkpoint marked as dist_resume's (:func:`is_toolkit`), once its format version is
    one this dist_resume reads and every entry is what ``save_checkpoint`` writes (:func:`meta_problem`). Local.

    Raises :class:`~dist_resume.errors.NotACheckpointError` naming ``source`` and the entry: a newer format version
    (upgrade to read it), or a version, ``meta`` or entry that no save writes (damaged or edited: resume from another
    checkpoint).

    Example::

        >>> toolkit_meta({"format": "dist_resume", "meta": {"step": 3}}, "ckpt.pt")
        {'step': 3}
    """
    _check_version(obj.get(Key.VERSION, FORMAT_VERSION), source)
    meta = obj.get(Key.META)
    meta = {} if meta is None else meta  # (not `or {}`: the truth value of what a damaged file holds may raise)
    if not isinstance(meta, Mapping):
        raise NotACheckpointError(
            f"{source} is marked as a dist_resume checkpoint but its {Key.META!r} entry is "
            f"{type(meta).__name__}, not a mapping (the file is damaged or was edited)"
        )
    for key in (*_COUNTS, *_TEXTS, "saved_at", DDP_BUCKETS):
        problem = meta_problem(key, meta.get(key))
        if problem is not None:
            raise NotACheckpointError(
                f"{source} is marked as a dist_resume checkpoint but its {Key.META!r} entry {key!r} is {problem} "
                "(the file is damaged or was edited); resume from another checkpoint"
            )
    return dict(meta)


def _check_version(version: Any, source: str) -> None:
    """Refuse a format version this dist_resume does not read: newer than :data:`FORMAT_VERSION`, or not one at all."""
    if type(version) is not int or version < 1:
        raise NotACheckpointError(
            f"{source} is marked as a dist_resume checkpoint but its {Key.VERSION!r} is {described(version, 40)}, not "
            "a format version (the file is damaged or was edited); resume from another checkpoint"
        )
    if version > FORMAT_VERSION:
        raise NotACheckpointError(
            f"{source} is a dist_resume checkpoint of format version {described(version, 40)}, written by a newer dist_resume; "
            f"this one ({__version__}) reads format version {FORMAT_VERSION}, and would read a newer one wrong: "
            "upgrade dist_resume to read it"
        )
