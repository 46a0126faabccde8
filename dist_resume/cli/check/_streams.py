"""How far apart two runs' RNG streams are, for ``dist-resume check``'s diagnosis: each rank's saved streams in the
reference and in the interrupted run, compared, and for torch's CPU stream and Python's ``random`` (both Mersenne
Twisters) the number of 32-bit draws one is ahead of the other, found by drawing from a copy of one until it is the
other (at most :data:`WORDS` draws each way).

That number is the evidence the diagnosis reads: a resumed run 2 draws ahead made one 64-bit draw more (what a
``DataLoader`` without ``generator=`` draws for each new iterator); ahead by more, it drew something again that the
saved streams had already drawn (a batch drawn before the save); behind, the uninterrupted run drew more (work after a
save that a resumed run does not redo, or streams seeded afresh instead of restored); no number, the streams are not
one stream at two places (not restored, or farther apart than :data:`WORDS`). Local.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from .._compare import compare_values

__all__ = ["WORDS", "RankStreams", "rank_streams"]

WORDS: Final = 1 << 16  # draws tried each way: ~0.2 s for torch's stream here


@dataclass(frozen=True)
class RankStreams:
    """One rank's streams at a step: which differ between the runs (``differ``: ``torch``, ``python``, ``numpy``,
    ``device``, ``seed``) and, for ``torch`` and ``python``, by how many 32-bit draws (``shifts``: positive, the
    interrupted run is ahead; negative, behind; None, not within :data:`WORDS` either way)."""

    rank: int
    differ: tuple[str, ...]
    shifts: Mapping[str, int | None] = field(default_factory=dict)


def _torch_steps(start: torch.Tensor, goal: torch.Tensor) -> int | None:
    g = torch.Generator()
    try:
        g.set_state(start.detach().to("cpu", torch.uint8).contiguous())
    except (RuntimeError, ValueError, TypeError):  # not a CPU generator's state
        return None
    goal = goal.detach().to("cpu", torch.uint8)
    word = torch.empty(1, dtype=torch.int32)  # one 32-bit draw each (random64 would be two)
    for n in range(1, WORDS + 1):
        word.random_(generator=g)
        if torch.equal(g.get_state(), goal):
            return n
    return None


_BLOCK: Final = 624  # the Mersenne Twister's words per block


def _python_state(state: Any) -> Any:
    version, internal, gauss = state
    return int(version), tuple(int(x) for x in internal), gauss


def _python_steps(start: Any, goal: Any) -> int | None:
    r = random.Random()
    try:
        r.setstate(_python_state(start))
        goal = _python_state(goal)
    except (TypeError, ValueError, IndexError):
        return None
    # the state's last number is the twister's place in its 624-word block: only every 624th count can match
    first = (goal[1][-1] - r.getstate()[1][-1]) % _BLOCK or _BLOCK
    r.getrandbits(32 * first)  # one 32-bit draw per 32 bits asked
    for n in range(first, WORDS + 1, _BLOCK):
        if r.getstate() == goal:
            return n
        r.getrandbits(32 * _BLOCK)
    return None


_STEPS: Final = {"torch": _torch_steps, "python": _python_steps}


def _shift(name: str, a: Any, b: Any) -> int | None:
    steps = _STEPS[name]
    ahead = steps(a, b)
    if ahead is not None:
        return ahead
    behind = steps(b, a)
    return -behind if behind is not None else None


def rank_streams(a: Any, b: Any, *, shifts: Sequence[str] = ("torch", "python")) -> tuple[RankStreams, ...]:
    """Each rank's streams in ``a`` (the reference's saved RNG state: a list, index = rank, of
    :func:`~dist_resume.rng_state_dict` dicts) and ``b`` (the interrupted run's), compared; ``shifts`` names the
    streams whose distance is measured. () when either is not such a list or their ranks differ. Local."""
    if not (isinstance(a, list) and isinstance(b, list) and a and len(a) == len(b)):
        return ()
    if not all(isinstance(r, Mapping) for r in (*a, *b)):
        return ()
    found = []
    for rank, (x, y) in enumerate(zip(a, b)):
        differ = tuple(str(k) for k in x if k in y and compare_values(x[k], y[k]) is not None)
        measured = {k: _shift(k, x[k], y[k]) for k in differ if k in shifts and k in _STEPS}
        found.append(RankStreams(rank, differ, measured))
    return tuple(found)
