"""The keywords 0.3 moved (CHANGELOG.md, "Migrating from 0.2"): a call that still passes one gets a
:class:`~dist_resume.errors.UsageError` saying where it went, instead of Python's bare ``TypeError``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, Final, ParamSpec, TypeVar

from .._core.errors import UsageError
from .options import ResumeOptions

__all__ = ["MIGRATION", "moved_keyword", "refuses_moved_keywords"]

MIGRATION: Final = "the table 'Migrating from 0.2' in CHANGELOG.md maps every 0.2 call to its 0.3 spelling"
_OPTIONS: Final = frozenset(f.name for f in dataclasses.fields(ResumeOptions))
_ELSEWHERE: Final = {
    "sampler": "sampler= became dataloader= (a DataLoader over a ResumableDistributedSampler, or the sampler itself)",
    "after_write": "save_checkpoint_async() no longer takes after_write=: call your function on handle.wait()'s "
    "result, or save through a CheckpointManager, which rotates after each write",
}

P = ParamSpec("P")
R = TypeVar("R")


def moved_keyword(name: str, value: Any, where: str) -> str | None:
    """Where keyword ``name`` (given ``value``) went in 0.3, as a sentence for ``where`` (``"resume()"``), or None."""
    if name in _OPTIONS and "save" in where:
        if name == "rng":
            return f"{where} got rng=: since 0.3 a save always saves every rank's RNG streams (drop rng=)"
        return f"{where} got {name}=: it is a resume option (dist_resume.ResumeOptions); a save takes none"
    if name in _OPTIONS:
        return (
            f"{where} got {name}={value!r}: since 0.3 the resume options are one value, "
            f"options=dist_resume.ResumeOptions({name}={value!r})"
        )
    if name in _ELSEWHERE:
        return f"{where} got {name}=: {_ELSEWHERE[name]}"
    return None


def refuses_moved_keywords(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, raising :class:`UsageError` naming the new spelling for a keyword 0.3 moved that ``fn`` does not take."""
    takes = set(inspect.signature(fn).parameters)
    where = f"{fn.__name__}()"

    @functools.wraps(fn)
    def checked(*args: P.args, **kwargs: P.kwargs) -> R:
        for name, value in kwargs.items():
            if name not in takes and (said := moved_keyword(name, value, where)) is not None:
                raise UsageError(f"{said}; {MIGRATION}", hint=said)
        return fn(*args, **kwargs)

    return checked
