"""A sharded checkpoint folder read into an FSDP2 model's own shards: the structure first, then ``dcp.load``.

:func:`read_sharded_skeleton` reads what is small (the manifest, ``train_state.pt``, DCP's ``.metadata`` and the
non-tensor DCP entries such as the optimizer's ``param_groups``) and stands every DCP tensor in by a tensor on the
meta device of its full shape and dtype: the restore plan validates names, shapes and dtypes against that, and
nothing of the tensor data has been read. :func:`load_into_shards` then lets torch's DCP reader fill the live
destinations (DTensor shards, plain buffers, fresh optimizer state) in place, at any world size: DCP reads, on
each rank, only the saved chunks that overlap its boxes. No rank ever holds a full tensor: what it holds for a
moment is one saved chunk (the saving rank's shard of one tensor), read, copied into its box and let go.

Collective for :func:`load_into_shards` (``dcp.load`` on every rank); local for :func:`read_sharded_skeleton`.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from .._core.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError
from .._core.types import PathLike
from .._format.load import load_torch_file
from .._format.manifest import TRAIN_STATE
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .sharded import SHARDED_LAYOUT, checked_manifest, join_payload

__all__ = ["read_sharded_skeleton", "load_into_shards"]


def _set(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    node: Any = root
    for key, nxt in itertools.pairwise(path):
        default: Any = [] if type(nxt) is int else {}
        if isinstance(node, list):
            node.extend([None] * (key + 1 - len(node)))
            if node[key] is None:
                node[key] = default
        else:
            node.setdefault(key, default)
        node = node[key]
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        root = root[key]
    return root


def _dcp_skeleton(folder: Path, weights_only: bool) -> tuple[dict[str, Any], dict[int, str]]:
    """The DCP state's structure with meta tensors, its objects read; ``{id(meta tensor): DCP key}``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from .dcp import _Planner, _Reader
    from .dcp_metadata import read_dcp_metadata

    metadata = read_dcp_metadata(folder, weights_only=weights_only)
    planner_data = metadata.planner_data or {}
    root: dict[str, Any] = {}
    objects: dict[str, Any] = {}
    keys: dict[int, str] = {}
    object_paths = []
    for fqn, md in metadata.state_dict_metadata.items():
        path = tuple(planner_data.get(fqn) or (fqn,))
        if isinstance(md, TensorStorageMetadata):
            stand_in = torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            keys[id(stand_in)] = fqn
            _set(root, path, stand_in)
        elif isinstance(md, BytesStorageMetadata):
            _set(objects, path, md)
            object_paths.append(path)
        else:
            raise NotACheckpointError(f"DCP entry {fqn!r} of {str(folder)!r} is {type(md).__name__}")
    if object_paths:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            try:
                dcp_load(
                    objects,
                    storage_reader=_Reader(folder, weights_only),
                    planner=_Planner(folder, weights_only),
                    no_dist=True,
                )
            except CheckpointError:
                raise
            except BaseException as err:  # CheckpointException is a BaseException
                if isinstance(err, (KeyboardInterrupt, SystemExit)):
                    raise
                raise _unreadable(folder, err) from err
        for path in object_paths:
            _set(root, path, _get(objects, path))
    return root, keys


def _unreadable(folder: Path, err: BaseException) -> CheckpointCorruptError:
    detail = (str(err).splitlines() or [""])[0][:200]
    return CheckpointCorruptError(
        f"cannot read sharded checkpoint {str(folder)!r} ({type(err).__name__}: {detail}); a .distcp file is "
        "missing, truncated or damaged: copy the whole folder again, or resume from an earlier checkpoint"
    )


def read_sharded_skeleton(path: PathLike, *, weights_only: bool = True) -> tuple[CheckpointParts, dict[int, str]]:
    """A sharded checkpoint folder as :class:`CheckpointParts` whose DCP tensors are meta stand-ins, and
    ``{id(stand-in): DCP key}`` to load each into its destination later (:func:`load_into_shards`). Local.

    The manifest is checked first (every file there with its size); the train state is read whole (it is small).
    """
    folder = Path(path)
    manifest = checked_manifest(folder)
    train_state = load_torch_file(folder / TRAIN_STATE, map_location="cpu", mmap=False, weights_only=weights_only)
    if not isinstance(train_state, Mapping) or SHARDED_LAYOUT not in train_state:
        raise NotACheckpointError(f"{str(folder / TRAIN_STATE)!r} is not the train state of a sharded checkpoint")
    dcp_state, keys = _dcp_skeleton(folder, weights_only)
    absent = [c for c in manifest.contents if c not in dcp_state]
    if absent:
        raise CheckpointCorruptError(f"sharded checkpoint {str(folder)!r}: its DCP files hold no {absent}")
    parts = split_checkpoint(join_payload(dcp_state, train_state), source=f"sharded checkpoint {str(folder)!r}")
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    meta = {**parts.meta, "source_layout": Layout.SHARDED.value, "files": files}
    return dataclasses.replace(parts, layout=Layout.SHARDED, meta=meta), keys


def load_into_shards(path: PathLike, targets: Mapping[str, torch.Tensor], *, weights_only: bool = True) -> None:
    """Fill each destination of ``targets`` (``{DCP key: DTensor or plain tensor}``) from the folder, in place.

    Collective: every rank calls it with the same keys (its own destinations), as ``dcp.load`` needs. DCP reshards:
    the folder may have been written at any world size and mesh. A failure on any rank raises
    :class:`CheckpointCorruptError` on every rank (DCP gathers every rank's outcome).
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from .dcp import _Reader

    folder = Path(path)
    try:
        dcp_load(
            dict(targets),
            storage_reader=_Reader(folder, weights_only),
            planner=DefaultLoadPlanner(allow_partial_load=False),
        )
    except CheckpointError:
        raise
    except BaseException as err:  # CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        inner = [exc for exc, _ in getattr(err, "failures", {}).values()]
        own = next((exc for exc in inner if isinstance(exc, CheckpointError)), None)
        if own is not None:
            raise own from err
        raise _unreadable(folder, inner[0] if inner else err) from err
