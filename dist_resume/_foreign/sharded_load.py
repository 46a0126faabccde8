"""A sharded checkpoint folder (or any DCP folder) read into an FSDP2 model's own shards: the structure first, then
``dcp.load``.

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
import warnings
from collections.abc import Mapping
from typing import Any, Final

import torch

from .._core.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError
from .._core.location import Location
from .._core.torch_compat.wording import dcp_cause
from .._core.tree import set_path
from .._format.load import load_torch_file
from .._format.manifest import TRAIN_STATE
from .._format.sniff import check_walkable
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .._state.optim.keys import normalize_optimizer_state
from .sharded import checked_layout, checked_manifest, join_payload

__all__ = ["read_sharded_skeleton", "read_dcp_skeleton", "load_into_shards"]


def _get(root: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        root = root[key]
    return root


def _dcp_skeleton(folder: Location, weights_only: bool) -> tuple[dict[str, Any], dict[int, str]]:
    """The DCP state's structure with meta tensors, its objects read; ``{id(meta tensor): DCP key}``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from .dcp import DcpPlanner
    from .dcp_metadata import read_dcp_metadata
    from .dcp_reader import DcpReader

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
            set_path(root, path, stand_in)
        elif isinstance(md, BytesStorageMetadata):
            set_path(objects, path, md)
            object_paths.append(path)
        else:
            raise NotACheckpointError(f"DCP entry {fqn!r} of {str(folder)!r} is {type(md).__name__}")
    if object_paths:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            try:
                dcp_load(
                    objects,
                    storage_reader=DcpReader(folder, weights_only),
                    planner=DcpPlanner(folder, weights_only),
                    no_dist=True,
                )
            except CheckpointError:
                raise
            except BaseException as err:  # CheckpointException is a BaseException
                if isinstance(err, (KeyboardInterrupt, SystemExit)):
                    raise
                cause = dcp_cause(err)
                if isinstance(cause, CheckpointError):
                    raise cause from err
                raise _unreadable(folder, cause) from err
        for path in object_paths:
            set_path(root, path, _get(objects, path))
    return root, keys


_PARTLY: Final = (
    " (found while the shards were filled: the model and optimizer may hold part of it; "
    "resume(..., options=ResumeOptions(verify=True)) checks every file's CRC-32 before anything changes)"
)


def _unreadable(folder: Location, err: BaseException, partly: bool = False) -> CheckpointCorruptError:
    detail = (str(err).splitlines() or [""])[0][:200]
    held = _PARTLY if partly else ""
    return CheckpointCorruptError(
        f"cannot read sharded checkpoint {str(folder)!r} ({type(err).__name__}: {detail}){held}; a .distcp file is "
        "missing, truncated or damaged: copy the whole folder again, or resume from an earlier checkpoint"
    )


def read_sharded_skeleton(
    path: Location, *, weights_only: bool = True, share: tuple[int, int] | None = None
) -> tuple[CheckpointParts, dict[int, str]]:
    """A sharded checkpoint folder as :class:`CheckpointParts` whose DCP tensors are meta stand-ins, and
    ``{id(stand-in): DCP key}`` to load each into its destination later (:func:`load_into_shards`). Local.

    The folder is checked first (:func:`~dist_resume._foreign.sharded.checked_manifest`: every file there with its
    size, nothing else, ``.metadata`` describing the shards); with ``share`` ``(rank, world_size)`` this rank also
    checks the CRC-32s of its part of the files, so that the ranks together check every byte the fill will read
    before anything changes. The train state is read whole (it is small).
    """
    folder = path
    manifest = checked_manifest(folder, share)
    train_state = load_torch_file(folder / TRAIN_STATE, map_location="cpu", mmap=False, weights_only=weights_only)
    checked_layout(train_state, repr(str(folder / TRAIN_STATE)))
    dcp_state, keys = _dcp_skeleton(folder, weights_only)
    absent = [c for c in manifest.contents if c not in dcp_state]
    if absent:
        raise CheckpointCorruptError(f"sharded checkpoint {str(folder)!r}: its DCP files hold no {absent}")
    where = f"sharded checkpoint {str(folder)!r}"
    parts = split_checkpoint(join_payload(dcp_state, train_state, where), source=where)
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    meta = {**parts.meta, "source_layout": Layout.SHARDED.value, "files": files}
    return dataclasses.replace(parts, layout=Layout.SHARDED, meta=meta), keys


def read_dcp_skeleton(path: Location, *, weights_only: bool = True) -> tuple[CheckpointParts, dict[int, str]]:
    """Any DCP folder as :func:`~dist_resume._foreign.dcp.read_dcp` splits it, its tensors meta stand-ins, and
    ``{id(stand-in): DCP key}`` (:func:`load_into_shards` fills the destinations later). Local."""
    from .dcp import is_dcp_folder
    from .dcp_metadata import METADATA

    folder = path
    if not is_dcp_folder(folder):
        raise NotACheckpointError(f"{str(folder)!r} is not a DCP folder (it needs {METADATA} and *.distcp files)")
    state, keys = _dcp_skeleton(folder, weights_only)
    state = check_walkable(state, f"DCP folder {str(folder)!r}")
    parts = split_checkpoint(state, source=f"DCP folder {str(folder)!r}")
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    meta = {**parts.meta, "source_layout": Layout.DCP.value, "files": files, "top_level_keys": sorted(map(str, state))}
    optimizer = normalize_optimizer_state(parts.optimizer)
    return dataclasses.replace(parts, layout=Layout.DCP, optimizer=optimizer, meta=meta), keys


def load_into_shards(path: Location, targets: Mapping[str, torch.Tensor], *, weights_only: bool = True) -> None:
    """Fill each destination of ``targets`` (``{DCP key: DTensor or plain tensor}``) from the folder, in place.

    Collective: every rank calls it with the same keys (its own destinations), as ``dcp.load`` needs. DCP reshards:
    the folder may have been written at any world size and mesh. A failure on any rank raises
    :class:`CheckpointCorruptError` on every rank (DCP gathers every rank's outcome).
    """
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from .dcp_reader import DcpReader

    folder = path
    try:
        with warnings.catch_warnings():  # one process (convert, tests): DCP says it reads alone; it may
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp_load(
                dict(targets),
                storage_reader=DcpReader(folder, weights_only),
                planner=DefaultLoadPlanner(allow_partial_load=False),
            )
    except CheckpointError:
        raise
    except BaseException as err:  # CheckpointException is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        cause, ranks = dcp_cause(err), _failing_ranks(err)
        if isinstance(cause, CheckpointError) and not isinstance(cause, CheckpointCorruptError):
            raise cause from err
        found = CheckpointCorruptError(f"{cause}{_PARTLY}") if isinstance(cause, CheckpointError) else None
        found = found or _unreadable(folder, cause, partly=True)
        if ranks and _world() > 1:  # DCP gathers every rank's outcome: every rank says whose read failed, alike
            detail = (str(cause).splitlines() or [""])[0][:300]
            found = CheckpointCorruptError(
                f"rank(s) {ranks} could not read their part of sharded checkpoint {folder.name} "
                f"({type(cause).__name__}: {detail}){_PARTLY}; where each node holds its own copy, copy the whole "
                "folder to those ranks' nodes again, or resume from an earlier checkpoint"
            )
            found.rank = ranks[0]
        raise found from err


def _world() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _failing_ranks(err: BaseException) -> list[int]:
    """The ranks DCP's CheckpointException says failed (its ``failures``, by rank), [] for another exception."""
    failures = getattr(err, "failures", None)
    return sorted(r for r in failures if isinstance(r, int)) if isinstance(failures, dict) else []
