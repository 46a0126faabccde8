"""An FSDP2 snapshot's file of one rank's own shards (dist_resume/_foreign/own_shards.py), in one process: written and
read back as stand-ins of the full shapes, every damaged field refused with the typed error, and a destination of
another box refused before anything is copied. The FSDP2 runs are tests/dist/test_memory_fsdp.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from dist_resume._foreign.own_shards import (
    Box,
    check_boxes,
    fill_own_shards,
    own_shards,
    read_own_shards,
    with_saved_shards,
)
from dist_resume._foreign.sharded import split_payload
from dist_resume.errors import CheckpointCorruptError, StateMismatchError


def _file(tmp_path: Path, **changes: Any) -> Path:
    payload = {"model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}, "step": 4, "epoch": 0}
    dcp_state, train_state = split_payload(payload)
    obj = own_shards(dcp_state, train_state, rank=1, world_size=2)
    obj.update(changes)
    path = tmp_path / "shards-00001.a.pt"
    torch.save(obj, path)
    return path


def test_a_rank_s_shards_read_back_as_stand_ins_and_fill_their_destinations(tmp_path: Path) -> None:
    parts, keys, saved, boxes = read_own_shards(_file(tmp_path), rank=1, world_size=2)
    assert parts.step == 4 and set(parts.model) == {"w", "b"}
    assert all(t.device.type == "meta" for t in parts.model.values())
    targets = {keys[id(t)]: torch.zeros(t.shape) for t in parts.model.values()}
    check_boxes(targets, boxes, "snapshot")  # whole tensors where whole ones were saved
    fill_own_shards(targets, saved)
    assert sorted(torch.cat([t.flatten() for t in targets.values()]).tolist()) == [0, 1, 1, 1, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "change",
    [
        {"format": "something else"},
        {"version": 2},
        {"rank": 0},
        {"world_size": 4},
        {"boxes": [None]},
        {"boxes": "none"},
        {"boxes": [[[2**70], [2], [0]], None]},
        {"boxes": [[[2, 3], [2, 3]], None]},
        {"boxes": [[["2", 3], [2, 3], [0, 0]], None]},
        {"boxes": [[[4, 3], [9, 3], [0, 0]], None]},
        {"state": [1, 2]},
        {"train_state": {"step": 4}},
    ],
)
def test_a_damaged_field_is_the_typed_error_naming_the_file(tmp_path: Path, change: dict[str, Any]) -> None:
    path = _file(tmp_path, **change)
    with pytest.raises(CheckpointCorruptError, match=r"shards-00001\.a\.pt"):
        read_own_shards(path, rank=1, world_size=2)


def test_a_missing_field_is_the_typed_error(tmp_path: Path) -> None:
    path = _file(tmp_path)
    obj = torch.load(path)
    del obj["boxes"]
    torch.save(obj, path)
    with pytest.raises(CheckpointCorruptError, match="lacks"):
        read_own_shards(path, rank=1, world_size=2)


def test_a_destination_of_another_box_or_structure_is_refused_before_any_copy() -> None:
    box = Box((4, 3), (2, 3), (2, 0))
    with pytest.raises(StateMismatchError, match="another world size, mesh or sharding"):
        check_boxes({"0": torch.zeros(2, 3)}, {"0": box}, "snapshot")  # a whole tensor where a shard was saved
    with pytest.raises(StateMismatchError, match="changed since the snapshot"):
        with_saved_shards({"model": {"w": torch.zeros(2, 3)}}, {"model": {"w": torch.zeros(3, 2)}})
    with pytest.raises(StateMismatchError, match="more tensors"):
        with_saved_shards({"model": {}}, {"model": {"w": torch.zeros(1)}})
