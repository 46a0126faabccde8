"""dist_resume._core.shards: where each mesh coordinate's box of a DTensor lies, as DTensor itself computes it."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # the oracle, private to torch

from dist_resume._core.shards import flat_range, is_dtensor, shard_region
from dist_resume.errors import StateMismatchError

SHAPES = [(7,), (1, 3), (3, 5), (8, 4), (5, 2, 3), (0, 4), (2, 9)]
LAYOUTS = [
    ((2,), (Shard(0),)),
    ((4,), (Shard(0),)),
    ((3,), (Shard(1),)),
    ((2, 2), (Replicate(), Shard(0))),  # HSDP
    ((2, 3), (Shard(0), Shard(0))),
    ((2, 2), (Shard(0), Shard(1))),
    ((2, 2), (Replicate(), Replicate())),
]


def test_every_box_is_the_one_dtensor_computes_and_the_boxes_tile_the_tensor() -> None:
    checked = 0
    for shape, (mesh_shape, placements) in itertools.product(SHAPES, LAYOUTS):
        if any(isinstance(p, Shard) and p.dim >= len(shape) for p in placements):
            continue
        covered = torch.zeros(shape, dtype=torch.int64)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            ours = shard_region(shape, mesh_shape, coordinate, placements)
            theirs = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coordinate), placements)
            assert ours == (tuple(theirs[0]), tuple(theirs[1])), (shape, mesh_shape, placements, coordinate)
            local_shape, offset = ours
            covered[tuple(slice(o, o + n) for o, n in zip(offset, local_shape))] += 1
            checked += 1
        replicas = math.prod(n for n, p in zip(mesh_shape, placements) if isinstance(p, Replicate))
        assert bool((covered == replicas).all()), (shape, mesh_shape, placements)
    assert checked > 150


def test_a_flat_range_is_given_exactly_when_the_box_is_one_contiguous_run() -> None:
    for shape in SHAPES + [(1, 1, 6), (4, 1)]:
        numbers = torch.arange(math.prod(shape)).reshape(shape)
        for local_shape in itertools.product(*(range(n + 1) for n in shape)):
            for offset in itertools.product(*(range(n - m + 1) for n, m in zip(shape, local_shape))):
                box = numbers[tuple(slice(o, o + m) for o, m in zip(offset, local_shape))].reshape(-1)
                start = flat_range(shape, local_shape, offset)
                if start is not None and box.numel():
                    assert torch.equal(box, torch.arange(start, start + box.numel())), (shape, local_shape, offset)
                whole_rows = all(m == n for m, n in zip(local_shape[1:], shape[1:]))
                if box.numel() and whole_rows:  # every box FSDP2 makes on dim 0 streams without assembling
                    assert start is not None


@pytest.mark.parametrize("placement", [Partial(), "strided"])
def test_placements_other_than_shard_and_replicate_are_refused(placement: object) -> None:
    if placement == "strided":
        from torch.distributed.tensor.placement_types import _StridedShard

        placement = _StridedShard(0, split_factor=2)
    with pytest.raises(StateMismatchError, match="only Shard and Replicate placements are supported"):
        shard_region((4, 4), (2,), (0,), (placement,))


def test_plain_tensors_are_no_dtensors() -> None:
    assert not is_dtensor(torch.ones(2)) and not is_dtensor(torch.nn.Parameter(torch.ones(2))) and not is_dtensor(None)
