"""Reading torch.distributed.checkpoint (DCP) folders into a plain state, without a process group.

The folder is read through torch's own DCP reader (``dcp.load`` with ``no_dist=True``) into an
empty structure rebuilt from the folder's metadata, so any sharding the writer used is gathered
into full tensors. With ``weights_only=True`` (the default) nothing is unpickled unsafely: torch's
reader opens ``.metadata`` with plain ``pickle`` and non-tensor entries with
``torch.load(weights_only=False)``; here the first goes through an unpickler that knows only DCP's
metadata classes and the second through ``torch.load(weights_only=True)``, and each tensor chunk is checked against
the dtype and shape ``.metadata`` declares for it before it is copied (:mod:`.dcp_reader`).

Optimizer state comes back in the form ``Optimizer.load_state_dict`` expects: state keyed by the
ints ``param_groups`` list (DCP stores them as digit strings, and ``Optimizer.load_state_dict``
would silently drop all of it), and DSD's FQN-keyed state as positions plus ``param_names``.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from .._core.errors import CheckpointCorruptError, CheckpointError, NotACheckpointError
from .._core.location import Location, local_path
from .._core.torch_compat.wording import is_damaged_pickle_error
from .._core.tree import map_tensors, set_path
from .._core.types import MapLocation
from .._format.load import rank_map_location
from .._format.sniff import check_walkable, unsafe_error
from .._layout.layout import CheckpointParts, Layout, split_checkpoint
from .._state.optim.keys import normalize_optimizer_state
from .dcp_metadata import METADATA as _METADATA
from .dcp_metadata import read_dcp_metadata
from .dcp_reader import DcpReader

__all__ = ["is_dcp_folder", "read_dcp", "load_dcp_state", "folder_device", "DcpPlanner"]


def is_dcp_folder(path: Location) -> bool:
    """True when ``path`` is a folder with a ``.metadata`` file and ``*.distcp`` files. Local."""
    folder = path
    return (folder / _METADATA).is_file() and any(p.name.endswith(".distcp") for p in folder.iterdir())


class DcpPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries load with ``torch.load(weights_only=True)``."""

    def __init__(self, folder: Location, weights_only: bool) -> None:
        super().__init__()
        self._folder = folder
        self._weights_only = weights_only

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        if not self._weights_only:
            super().load_bytes(read_item, value)
            return
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            raise unsafe_error(f"DCP entry {read_item.dest_index.fqn!r} of {str(self._folder)!r}", err) from err
        if self.flatten_state_dict:
            set_path(self.original_state_dict, tuple(self.mappings[read_item.dest_index.fqn]), obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _empty_state(metadata: Metadata) -> dict[str, Any]:
    """The nested structure DCP saved, with empty tensors and placeholders to read into."""
    root: dict[str, Any] = {}
    planner_data = metadata.planner_data or {}
    for fqn, md in metadata.state_dict_metadata.items():
        value: Any = md
        if isinstance(md, TensorStorageMetadata):
            value = torch.empty(md.size, dtype=md.properties.dtype)
        elif not isinstance(md, BytesStorageMetadata):
            raise NotACheckpointError(f"DCP entry {fqn!r} is {type(md).__name__}; only full tensors and objects load")
        path = planner_data.get(fqn)
        if path:
            set_path(root, tuple(path), value)
        else:
            root[fqn] = value
    return root


def _unreadable(folder: Location, err: BaseException) -> CheckpointCorruptError:
    detail = (str(err).splitlines() or [""])[0][:200]
    return CheckpointCorruptError(
        f"cannot read DCP folder {str(folder)!r} ({type(err).__name__}: {detail}); a .distcp file is missing "
        "or truncated: copy the whole folder, or resume from an earlier checkpoint"
    )


def load_dcp_state(path: Location, *, weights_only: bool = True) -> dict[str, Any]:
    """The whole nested state a DCP folder holds, on CPU, read by torch's DCP reader in this process. Local. A
    folder on an object store (a sharded checkpoint's) is read by ranges."""
    folder = path
    if not is_dcp_folder(folder):
        raise NotACheckpointError(f"{str(folder)!r} is not a DCP folder (it needs {_METADATA} and *.distcp files)")
    state = _empty_state(read_dcp_metadata(folder, weights_only=weights_only))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp_load(
                state,
                storage_reader=DcpReader(folder, weights_only),
                planner=DcpPlanner(folder, weights_only),
                no_dist=True,
            )
        except CheckpointException as err:  # a BaseException wrapping each rank's exception
            inner = [exc for exc, _ in err.failures.values()]
            own = next((exc for exc in inner if isinstance(exc, CheckpointError)), None)
            if own is not None:
                raise own from err
            raise _unreadable(folder, inner[0] if inner else err) from err
        except CheckpointError:
            raise
        except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError) as err:
            raise _unreadable(folder, err) from err
        except (TypeError, KeyError, AttributeError, IndexError, AssertionError) as err:
            # torch's planner trusts .metadata's structure (a key damaged into a tuple breaks its sorting);
            # raised inside torch only, it is damage, never a bug of ours
            if not is_damaged_pickle_error(err):
                raise
            raise _unreadable(folder, err) from err
    return check_walkable(state, f"DCP folder {str(folder)!r}")


def folder_device(map_location: MapLocation, folder: Location) -> torch.device:
    """The one device a folder's tensors go to: ``map_location`` as a device (None: this rank's). Local."""
    if isinstance(map_location, dict) or callable(map_location):
        raise CheckpointError(
            f"map_location={map_location!r} cannot be applied to DCP folder {str(folder)!r}: it has no device "
            "tags; pass a device ('cpu', 'cuda:1') or None for this rank's device"
        )
    if map_location is None or isinstance(map_location, int):
        return rank_map_location(map_location)
    return torch.device(map_location)


def read_dcp(path: Location, *, map_location: MapLocation = None, weights_only: bool = True) -> CheckpointParts:
    """A DCP folder as :class:`CheckpointParts`. Local: every rank may read it (no process group is used).

    The top level is split as a file's would be (``{"model": ..., "optim": ...}``, a bare state
    dict, ...), then the optimizer state is normalised (:func:`normalize_optimizer_state`).

    Example::

        >>> dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id="ckpt")
        >>> parts = read_dcp(Path("ckpt"), map_location="cpu")
    """
    folder = local_path(path, "reading a DCP folder")
    device = folder_device(map_location, folder)
    state = load_dcp_state(folder, weights_only=weights_only)
    if device.type != "cpu":
        state = map_tensors(state, lambda t: t.to(device))
    parts = split_checkpoint(state, source=f"DCP folder {str(folder)!r}")
    files = sorted(p.name for p in folder.iterdir() if p.is_file())
    meta = {
        **parts.meta,
        "source_layout": Layout.DCP.value,
        "files": files,
        "top_level_keys": sorted(map(str, state)),
    }
    return dataclasses.replace(
        parts, layout=Layout.DCP, optimizer=normalize_optimizer_state(parts.optimizer), meta=meta
    )
