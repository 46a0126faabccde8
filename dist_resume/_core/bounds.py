"""The ranges a checkpoint's counts, sizes and times must lie in: one owner of the words every refusal of them uses.

A pickle's (and JSON's) integers are unbounded, but what a writer puts there is a step, an epoch, a world size, a byte
count or a time: an int64 that is not negative, or seconds since 1970. A value outside (``-1``, ``10**30``, ``2**70``)
is damage or an edit, and code that takes it as it is fails far from the file (``float()`` of it overflows, a file
named ``ckpt_1000000000000000000000000000000.pt`` is written, a loop runs for ever). Torch-free: the readers that
answer without torch use it too.
"""

from __future__ import annotations

from typing import Any, Final

from .text import described

__all__ = ["MAX_INT64", "MAX_TIME", "count_problem", "time_problem"]

MAX_INT64: Final = (1 << 63) - 1  # steps, epochs, sizes, ranks: what an int64 holds
MAX_TIME: Final = 1e11  # saved_at: seconds since 1970, good until the year 5138


def count_problem(value: Any, *, least: int = 0) -> str | None:
    """Why ``value`` is not a count (an ``int``, not a ``bool``, from ``least`` to 2**63-1), or None. Local.

    Example::

        >>> count_problem(-1), count_problem(2**70) is not None, count_problem(7)
        ('-1 is not an int from 0 to 2**63-1', True, None)
    """
    if type(value) is not int or not least <= value <= MAX_INT64:  # (compared exactly: no float() of a huge int)
        return f"{described(value, 60)} is not an int from {least} to 2**63-1"
    return None


def time_problem(value: Any) -> str | None:
    """Why ``value`` is not a time in seconds (an int or a float within +-1e11, not NaN), or None. Local.

    Example::

        >>> time_problem(1.7e9), time_problem(float("nan")) is not None, time_problem(2**70) is not None
        (None, True, True)
    """
    # the bound first, compared exactly: float() (and math.isfinite) of an int past 1e308 raises OverflowError
    if type(value) not in (int, float) or not abs(value) <= MAX_TIME:  # NaN compares False: refused too
        return f"{described(value, 60)} is not a time in seconds"
    return None
