"""Whether a DCP tensor's chunks lie inside it and cover each of its elements exactly once.

torch's DCP reader fills only the elements some chunk covers: an element no chunk covers keeps whatever memory held,
and two chunks over one element leave the later one's value. :func:`cover_problem` says which of these a tensor's
chunks (as ``.metadata`` declares them) would do, or None.

Torch-free: this module imports nothing but the standard library.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

__all__ = ["MAX_CELLS", "cover_problem"]

MAX_CELLS: Final = 1 << 22  # a coverage grid larger than this is refused as too fragmented to be a real save

Dims = tuple[int, ...]


class _Box(Protocol):
    @property
    def offsets(self) -> Dims: ...

    @property
    def sizes(self) -> Dims: ...


def cover_problem(size: Dims, chunks: Sequence[_Box]) -> str | None:
    """What keeps ``chunks`` from covering each element of a tensor of ``size`` exactly once (a chunk of other
    dimensions or outside the tensor, elements missed or held twice), or None. Local."""
    ndim = len(size)
    for chunk in chunks:
        if len(chunk.offsets) != ndim or len(chunk.sizes) != ndim:
            return f"a chunk of {len(chunk.sizes)} dimensions in a tensor of {ndim}"
        if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, size)):
            return f"the chunk at {chunk.offsets} of extent {chunk.sizes} lies outside its size {size}"
    total = math.prod(size)
    held = sum(math.prod(c.sizes) for c in chunks)
    if held != total:
        return f"its chunks hold {held} elements, the tensor {total}"
    boxes = [c for c in chunks if math.prod(c.sizes)]
    return None if _disjoint(boxes, size) else "two of its chunks overlap (and so some element is in none)"


def _disjoint(boxes: list[_Box], size: Dims) -> bool:
    """No two boxes share an element (their volumes sum to the tensor's, so disjoint means an exact cover)."""
    if len(boxes) < 2:
        return True
    split = [d for d in range(len(size)) if any(b.sizes[d] != size[d] for b in boxes)]
    if len(split) <= 1:  # slabs along one dimension (FSDP's Shard(0)): sorted, each must end where the next starts
        d = split[0] if split else 0
        ordered = sorted(boxes, key=lambda b: b.offsets[d])
        return all(a.offsets[d] + a.sizes[d] <= b.offsets[d] for a, b in itertools.pairwise(ordered))
    cuts = [
        sorted({0, n, *(b.offsets[d] for b in boxes), *(b.offsets[d] + b.sizes[d] for b in boxes)})
        for d, n in enumerate(size)
    ]
    if math.prod(len(c) - 1 for c in cuts) > MAX_CELLS:
        return False
    seen: set[tuple[int, ...]] = set()
    for box in boxes:
        ranges = [range(cut.index(o), cut.index(o + s)) for cut, o, s in zip(cuts, box.offsets, box.sizes)]
        for cell in _product(ranges):
            if cell in seen:
                return False
            seen.add(cell)
    return True


def _product(ranges: list[range]) -> Iterable[tuple[int, ...]]:
    cells: list[tuple[int, ...]] = [()]
    for r in ranges:
        cells = [c + (i,) for c in cells for i in r]
    return cells
