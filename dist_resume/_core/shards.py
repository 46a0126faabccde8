"""Where a DTensor's local shard sits in its full tensor: placement arithmetic for ``Shard`` and ``Replicate``.

FSDP2 (``torch.distributed.fsdp.fully_shard``) turns each parameter into a ``DTensor``: ``Shard(0)``
on a 1-D mesh, ``(Replicate(), Shard(0))`` on a 2-D HSDP mesh. A shard is a box of the full tensor
(an offset and a shape per dimension), computed as DTensor computes it: mesh dimensions left to
right, each splitting its tensor dimension as ``torch.chunk`` does (chunks of ``ceil(n / k)``, the
last ones shorter or empty). :func:`shard_region` does it for any mesh coordinate, so rank 0 knows
every rank's box without asking; the tests hold it to DTensor's own answer on every rank.

Nothing here imports ``torch.distributed.tensor`` (1-2 s): a DTensor can only exist once that module
was imported, so :func:`is_dtensor` asks ``sys.modules``.
"""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import StateMismatchError

__all__ = [
    "is_dtensor",
    "local_of",
    "ShardSpec",
    "shard_region",
    "shard_spec",
    "rank_regions",
    "flat_range",
]


def is_dtensor(obj: Any) -> bool:
    """Whether ``obj`` is a ``torch.distributed.tensor.DTensor`` (a parameter FSDP2 sharded, or its state). Local."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(obj, module.DTensor)


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (``to_local()``, sharing its storage), or a plain tensor itself. Local."""
    if is_dtensor(tensor):
        local: torch.Tensor = tensor.to_local()  # type: ignore[attr-defined]
        return local
    return tensor


def shard_region(
    global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple[Any, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, offset)`` of the shard that mesh ``coordinate`` holds. Local; pure arithmetic.

    ``placements`` are ``Shard(dim)`` or ``Replicate()`` (one per mesh dimension); anything else
    (``Partial``, the ``_StridedShard`` of FSDP2 combined with tensor parallelism) raises
    :class:`StateMismatchError`.
    """
    shape, offset = list(global_shape), [0] * len(global_shape)
    for mesh_dim, placement in enumerate(placements):
        kind = type(placement).__name__
        if kind == "Replicate":
            continue
        if kind != "Shard":
            raise StateMismatchError(
                f"a DTensor placed {tuple(placements)} cannot be restored from a full tensor here: only Shard and "
                f"Replicate placements are supported (found {placement!r}); FSDP2 alone (fully_shard on a 1-D or "
                "2-D HSDP mesh) places parameters that way"
            )
        dim, chunks, rank = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        size = shape[dim]
        chunk = -(-size // chunks)
        start = min(size, chunk * rank)
        shape[dim] = max(0, min(size, chunk * rank + chunk) - start)
        offset[dim] = offset[dim] + start if shape[dim] else global_shape[dim]  # DTensor puts empty boxes at the end
    return tuple(shape), tuple(offset)


@dataclass(frozen=True, slots=True)
class ShardSpec:
    """One DTensor described: its full shape and dtype, its mesh and placements, and this rank's box."""

    global_shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[Any, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]
    mesh: Any = field(repr=False, compare=False)  # the DeviceMesh

    def slices(self) -> tuple[slice, ...]:
        """Index a full tensor with this to get this rank's shard (a view)."""
        return tuple(slice(o, o + n) for o, n in zip(self.offset, self.local_shape))

    @property
    def local_nbytes(self) -> int:
        return math.prod(self.local_shape) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.global_shape) * self.dtype.itemsize


def shard_spec(tensor: Any) -> ShardSpec:
    """Describe a DTensor (its global shape, placements and this rank's box). Local."""
    mesh = tensor.device_mesh
    placements = tuple(tensor.placements)
    global_shape = tuple(tensor.shape)
    coordinate = mesh.get_coordinate()
    if coordinate is None:  # this rank is not in the mesh: it holds nothing
        return ShardSpec(
            global_shape, tensor.dtype, placements, (0,) * len(global_shape), (0,) * len(global_shape), mesh
        )
    local_shape, offset = shard_region(global_shape, tuple(mesh.shape), tuple(coordinate), placements)
    return ShardSpec(global_shape, tensor.dtype, placements, local_shape, offset, mesh)


def rank_regions(spec: ShardSpec) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
    """``(global rank, local shape, offset)`` for every rank of ``spec``'s mesh, in mesh order. Local."""
    ranks = spec.mesh.mesh  # global ranks, laid out as the mesh
    mesh_shape = tuple(ranks.shape)
    out = []
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):  # row-major: mesh order
        shape, offset = shard_region(spec.global_shape, mesh_shape, coordinate, spec.placements)
        out.append((int(ranks[coordinate]), shape, offset))
    return out


def flat_range(global_shape: tuple[int, ...], local_shape: tuple[int, ...], offset: tuple[int, ...]) -> int | None:
    """The element offset where a box starts in the full tensor laid out row-major, when the box is one contiguous
    run of it (dims before the first split one have size 1 in the box, dims after it are whole); else None."""
    split = next((d for d, (n, g) in enumerate(zip(local_shape, global_shape)) if n != g), None)
    if split is None:
        return 0
    if any(n != 1 for n in local_shape[:split]) or local_shape[split + 1 :] != global_shape[split + 1 :]:
        return None if math.prod(local_shape) else 0
    strides = [math.prod(global_shape[d + 1 :]) for d in range(len(global_shape))]
    return sum(o * s for o, s in zip(offset, strides))
