"""One rank's own shards of an FSDP2 state as one torch file: the form of an FSDP2 snapshot in shared memory.

A sharded checkpoint folder holds every rank's shards in DCP's files (:mod:`.sharded`); a snapshot is each rank's alone,
in its node's memory, so that a restart on the same ranks reads back exactly what each rank held. :func:`own_shards`
makes the file's object from the DCP state and the train state :func:`~dist_resume._foreign.sharded.split_payload`
gives: every DTensor stands as its local tensor, and ``boxes`` says, tensor by tensor in walking order, which box of
which full tensor that is (global shape, local shape, offset: :class:`~dist_resume._core.shards.ShardSpec`'s); a plain
tensor (a buffer FSDP2 left whole, an optimizer's ``step``) is saved whole, its box None.

:func:`read_own_shards` reads it back as the DCP skeleton reader does (:mod:`.sharded_load`): the parts with a meta
stand-in of the full shape for every tensor, so that the restore plan validates names, shapes and dtypes before
anything changes; :func:`check_boxes` then refuses a destination whose box is not the saved one (another world size,
mesh or placement), and :func:`fill_own_shards` copies each saved local tensor into its destination's local tensor.
:func:`with_saved_shards` gives the live DCP state back with the saved local tensors in its DTensors (the same specs),
for a sharded checkpoint folder written from the snapshot without a copy from the device. Local, all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, StateMismatchError
from .._core.location import Location
from .._core.shards import is_dtensor, local_of, shard_spec
from .._core.text import preview
from .._core.torch_compat.private import dtensor_with_local
from .._core.tree import iter_tensors, map_tensors
from .._core.untrusted import untrusted
from .._format.load import load_torch_file
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .sharded import checked_layout, join_payload

__all__ = ["FORMAT", "Box", "own_shards", "read_own_shards", "check_boxes", "fill_own_shards", "with_saved_shards"]

FORMAT: Final = "dist_resume.fsdp2_own_shards"
_VERSION: Final = 1
_FIELDS: Final = ("format", "version", "rank", "world_size", "state", "boxes", "train_state")


@dataclasses.dataclass(frozen=True, slots=True)
class Box:
    """Which part of a full tensor a rank's local tensor is: the full shape, the local shape, the offset."""

    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    offset: tuple[int, ...]

    def describe(self) -> str:
        return f"the box {self.local_shape} at {self.offset} of a tensor of shape {self.global_shape}"


def _box(tensor: torch.Tensor) -> Box | None:
    if not is_dtensor(tensor):
        return None
    spec = shard_spec(tensor)
    return Box(spec.global_shape, spec.local_shape, spec.offset)


def own_shards(
    dcp_state: Mapping[str, Any], train_state: Mapping[str, Any], *, rank: int, world_size: int
) -> dict[str, Any]:
    """The object of this rank's snapshot file: ``dcp_state`` with every DTensor as its local tensor (no copy), the box
    of each tensor in walking order, and ``train_state``. Local."""
    boxes: list[list[list[int]] | None] = []

    def local(tensor: torch.Tensor) -> torch.Tensor:
        box = _box(tensor)
        boxes.append(None if box is None else [list(box.global_shape), list(box.local_shape), list(box.offset)])
        return local_of(tensor).detach()

    state = map_tensors(dict(dcp_state), local)
    return {
        "format": FORMAT,
        "version": _VERSION,
        "rank": rank,
        "world_size": world_size,
        "state": state,
        "boxes": boxes,
        "train_state": dict(train_state),
    }


def _ints(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(v) is int and 0 <= v < 2**63 for v in value):
        raise CheckpointCorruptError(f"{where}: a box field is {type(value).__name__}, not a list of sizes")
    return tuple(value)


def _boxes(raw: Any, tensors: list[torch.Tensor], where: str) -> list[Box | None]:
    if not isinstance(raw, list) or len(raw) != len(tensors):
        found = len(raw) if isinstance(raw, list) else type(raw).__name__
        raise CheckpointCorruptError(f"{where} lists {found} boxes for {len(tensors)} tensors")
    boxes: list[Box | None] = []
    for entry, tensor in zip(raw, tensors):
        if entry is None:
            boxes.append(None)
            continue
        if not isinstance(entry, list) or len(entry) != 3:
            raise CheckpointCorruptError(
                f"{where}: a box is {type(entry).__name__}, not [global shape, local shape, offset]"
            )
        box = Box(_ints(entry[0], where), _ints(entry[1], where), _ints(entry[2], where))
        if (
            box.local_shape != tuple(tensor.shape)
            or not len(box.global_shape) == len(box.local_shape) == len(box.offset)
            or any(o + n > g for g, n, o in zip(box.global_shape, box.local_shape, box.offset))
        ):
            raise CheckpointCorruptError(
                f"{where}: {box.describe()} does not describe its tensor of shape {tuple(tensor.shape)}"
            )
        boxes.append(box)
    return boxes


def read_own_shards(
    path: Location, *, rank: int, world_size: int, weights_only: bool = True
) -> tuple[CheckpointParts, dict[int, str], dict[str, torch.Tensor], dict[str, Box | None]]:
    """This rank's snapshot file ``path`` (memory-mapped) as :class:`CheckpointParts` whose DCP tensors are meta
    stand-ins of their full shapes; ``{id(stand-in): key}``; ``{key: saved local tensor}``; ``{key: its box}``. Local.

    A file of another rank or world size, or one whose structure is not what :func:`own_shards` writes, raises
    :class:`CheckpointCorruptError` naming it."""
    where = f"the FSDP2 snapshot {str(path)!r}"
    obj = load_torch_file(path, map_location="cpu", mmap=True, weights_only=weights_only)
    with untrusted(where, "its layout"):
        if not isinstance(obj, dict) or obj.get("format") != FORMAT or obj.get("version") != _VERSION:
            raise CheckpointCorruptError(f"{where} is not a snapshot of one rank's shards ({FORMAT} {_VERSION})")
        missing = [f for f in _FIELDS if f not in obj]
        if missing:
            raise CheckpointCorruptError(f"{where} lacks {preview(missing)}")
        if obj["rank"] != rank or obj["world_size"] != world_size:
            raise CheckpointCorruptError(
                f"{where} holds rank {obj['rank']!r}'s shards of {obj['world_size']!r} ranks, not rank {rank}'s of "
                f"{world_size}"
            )
        state, train_state = obj["state"], obj["train_state"]
        if not isinstance(state, dict) or not isinstance(train_state, dict):
            raise CheckpointCorruptError(f"{where}: its state and train state are not dicts")
        checked_layout(train_state, where)
        tensors = list(iter_tensors(state))
        boxes = _boxes(obj["boxes"], tensors, where)
    keys: dict[int, str] = {}
    saved: dict[str, torch.Tensor] = {}
    saved_boxes: dict[str, Box | None] = {}

    def stand_in(tensor: torch.Tensor) -> torch.Tensor:
        key = str(len(saved))
        box = boxes[len(saved)]
        shape = tensor.shape if box is None else box.global_shape
        meta = torch.empty(shape, dtype=tensor.dtype, device="meta")
        keys[id(meta)], saved[key], saved_boxes[key] = key, tensor, box
        return meta

    skeleton = map_tensors(state, stand_in)
    parts = split_checkpoint(join_payload(skeleton, train_state, where), source=where)
    meta = {**parts.meta, "source_layout": Layout.SHARDED.value, "files": [path.name]}
    return dataclasses.replace(parts, layout=Layout.SHARDED, meta=meta), keys, saved, saved_boxes


def check_boxes(targets: Mapping[str, torch.Tensor], boxes: Mapping[str, Box | None], source: str) -> None:
    """Refuse (:class:`StateMismatchError`) a destination that is not the saved tensor's box: a DTensor where a whole
    tensor was saved, or the reverse, or another box (the snapshot was taken at another world size, mesh or
    placement). Local; changes nothing."""
    for key, dst in targets.items():
        saved, live = boxes[key], _box(dst)
        if saved != live:
            what = "a whole tensor" if saved is None else saved.describe()
            found = "a whole tensor" if live is None else live.describe()
            raise StateMismatchError(
                f"{source} holds {what} where this rank holds {found}: it was taken with another world size, mesh or "
                "sharding; resume from the folder's checkpoint (a sharded checkpoint reshards)"
            )


def fill_own_shards(targets: Mapping[str, torch.Tensor], saved: Mapping[str, torch.Tensor]) -> None:
    """Copy each saved local tensor into its destination's local tensor (its box checked: :func:`check_boxes`). Local."""
    with torch.no_grad():
        for key, dst in targets.items():
            local = local_of(dst)
            if local.numel():
                local.copy_(saved[key])


def with_saved_shards(live_state: Mapping[str, Any], saved_state: Mapping[str, Any]) -> dict[str, Any]:
    """``live_state`` (this rank's DCP state, DTensor leaves) with each tensor replaced by the saved one in the same
    walking position: a DTensor keeps its spec around the saved local tensor, a plain tensor is the saved one.
    Local; no tensor is copied. Raises :class:`StateMismatchError` when the two do not line up."""
    saved = list(iter_tensors(saved_state))
    used = iter(saved)

    def swap(tensor: torch.Tensor) -> torch.Tensor:
        local = next(used, None)
        if local is None or tuple(local_of(tensor).shape) != tuple(local.shape) or local.dtype != tensor.dtype:
            shown = None if local is None else (tuple(local.shape), local.dtype)
            raise StateMismatchError(
                f"the snapshot's tensor {shown} does not line up with the live one {tuple(local_of(tensor).shape)}, "
                f"{tensor.dtype}: the model or optimizer changed since the snapshot; save from the live state"
            )
        return dtensor_with_local(tensor, local) if is_dtensor(tensor) else local

    state: dict[str, Any] = map_tensors(dict(live_state), swap)
    if next(used, None) is not None:
        raise StateMismatchError(
            "the snapshot holds more tensors than the live state: the model or optimizer changed since the snapshot; "
            "save from the live state"
        )
    return state
