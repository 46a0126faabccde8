"""Whether a strided tensor's elements may share memory, from its shape and strides alone: torch-free, so that the
readers without torch (``dist-resume list``'s stub reader) and with it (:mod:`.tensor_kind`) judge a tensor alike."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["overlapping"]


def overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``strides`` may be one place in memory (an ``expand``-ed view,
    a stride of 0): False only where no two can (sorted by stride, each dimension steps past all the smaller ones).
    Local. A transposed, sliced or size-1-expanded tensor does not overlap; an empty one never does.

    Example::

        >>> overlapping((2, 3), (1, 2)), overlapping((4,), (0,)), overlapping((1, 3), (0, 1))
        (False, True, False)
    """
    if 0 in shape:
        return False
    reach = 0  # the largest offset the smaller dimensions span
    for stride, size in sorted((st, n) for st, n in zip(strides, shape) if n > 1):
        if stride <= reach:
            return True
        reach += stride * (size - 1)
    return False
