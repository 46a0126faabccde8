"""Saving an FSDP2 model: every rank writes its own shards into one folder, committed atomically; or one file.

:func:`save_sharded` writes dist_resume's sharded checkpoint folder (the format: :mod:`dist_resume._foreign.sharded`,
:mod:`dist_resume._format.manifest`). The commit, step by step, every step agreed by all ranks before the next:

1. rank 0 creates ``.<name>.<16 hex>.tmp/`` next to the destination;
2. every rank builds its payload (DTensor leaves) and checks that it sees the folder; rank 0 writes
   ``train_state.pt`` into it (fsynced);
3. ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter`` (``sync_files=True``): every rank writes and
   fsyncs its ``__<rank>_<n>.distcp``, rank 0 ``.metadata``; DCP relays a rank's failure to every rank;
4. every rank reads back its own files for their sizes and CRC-32s;
5. rank 0 checks that the folder holds exactly those files and everything ``.metadata`` names, writes
   ``manifest.json`` (fsynced), fsyncs the folder, renames it to its name and fsyncs the parent.

A failure on any rank at any step makes every rank raise the same :class:`CheckpointWriteError` (its ``rank`` the
failing one) and rank 0 removes the temporary folder: nothing is committed, the previous checkpoint stays the
latest. A process killed mid-save leaves only the temporary folder, which no reader counts and
``CheckpointManager`` removes on its next save. Into a folder on an object store, where nothing can be renamed, each
rank stages its files on local disk and uploads them, and the manifest uploaded last commits the folder
(:mod:`.sharded_remote`). ``full_state=True`` writes one ordinary torch file instead: :mod:`.full_state`.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._core.errors import CheckpointWriteError, DistResumeError, UsageError
from .._core.location import Location, RemotePath
from .._core.log import log_saved
from .._core.text import preview
from .._core.tree import map_tensors
from .._dist.agree import first_failure
from .._dist.comm import Outcome, all_gather_objects, collective_step, run_on_rank0
from .._foreign.sharded import new_manifest, split_payload
from .._format.atomic import atomic_write, commit_folder, make_temp_folder, remove_path, write_error
from .._format.manifest import DCP_METADATA, MANIFEST, SHARD_FILE, TRAIN_STATE, FileEntry, Manifest, file_entry
from .._format.sniff import CHECKPOINT_SUFFIXES
from .._state.sharded import is_sharded, sharded_parameters
from .sharded_remote import clear_destination, commit_remote, drop_staging, local_staging, upload_own

__all__ = [
    "writes_folder",
    "ShardedSave",
    "begin_sharded",
    "begin_sharded_from",
    "finish_sharded",
    "save_sharded",
    "agree_step",
]

Build = Callable[[], dict[str, Any]]


def writes_folder(model: nn.Module, full_state: bool) -> bool:
    """Whether a save of ``model`` writes a sharded checkpoint folder (FSDP2 and not ``full_state``). Local."""
    return not full_state and is_sharded(model)


def agree_step(error: BaseException | None, value: Any, step: str, dest: Location, group: Any) -> list[Any]:
    """Collective on ``group``: every rank's ``value`` after ``step`` of the save into ``dest``, or, when any rank failed,
    the lowest failing rank's error on every rank (nothing is committed: the caller removes what it began)."""
    mine = Outcome(value=value) if error is None else Outcome.failed(dist.get_rank(), error)
    with collective_step(f"{step} for {str(dest)!r}", CheckpointWriteError):
        outcomes: list[Outcome] = all_gather_objects(mine, group=group)
    what = (
        f"failed while {step}, so the sharded checkpoint {str(dest)!r} was not committed (the previous checkpoint, "
        "if any, is untouched)"
    )
    err = first_failure(outcomes, CheckpointWriteError, what)
    if err is not None:
        raise err from error
    return [o.value for o in outcomes]


def _need_numpy() -> None:
    if importlib.util.find_spec("numpy") is None:  # DCP's object collectives decode through tensor.numpy()
        raise CheckpointWriteError(
            "a sharded save uses torch.distributed.checkpoint, whose collectives need numpy: pip install numpy, "
            "or save one file with full_state=True"
        )


def _payload(build: Build) -> dict[str, Any]:
    _need_numpy()
    return build()


def _mesh_of(model: nn.Module) -> tuple[tuple[int, ...] | None, tuple[str, ...] | None]:
    specs = sharded_parameters(model)
    if not specs:
        return None, None
    mesh = next(iter(specs.values())).mesh
    names = getattr(mesh, "mesh_dim_names", None)
    return tuple(int(n) for n in mesh.shape), None if names is None else tuple(map(str, names))


def _own_files(tmp: Path, rank: int, train_state: bool) -> list[FileEntry]:
    """This rank's files in the folder (DCP's ``__<rank>_<n>.distcp``; rank 0: ``.metadata``, the train state)."""
    names = sorted(n for n in os.listdir(tmp) if (m := SHARD_FILE.match(n)) and int(m.group("rank")) == rank)
    if train_state:
        names += [DCP_METADATA, TRAIN_STATE]
    return [file_entry(tmp / n, rank) for n in names]


def _dcp_write(tmp: Path, state: dict[str, Any], group: Any) -> bool:
    """``dcp.save`` of this rank's shards into ``tmp``; False when another rank failed. DCP relays one rank's
    failure to every rank: only the rank that failed raises it here (its own cause), so that the agreement
    after names that rank."""
    import warnings

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    writer = FileSystemWriter(tmp, sync_files=True, single_file_per_rank=True, overwrite=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*existing checkpoint.*", category=UserWarning)
            dcp_save(state, storage_writer=writer, process_group=group)
    except CheckpointException as err:
        mine = err.failures.get(dist.get_rank())
        if mine is None:
            return False  # another rank failed: it says so in the agreement that follows
        exc = mine[0]
        cause = exc if isinstance(exc, DistResumeError) else write_error(tmp, exc)
        raise CheckpointWriteError(f"torch.distributed.checkpoint.save failed: {cause}") from exc
    return True


def _commit(tmp: Path, dest: Path, manifest: Manifest) -> None:
    """Rank 0: the folder holds what the ranks reported, then manifest, fsync, rename, fsync of the parent."""
    from .._foreign.dcp_metadata import read_dcp_metadata

    listed = {e.name for e in manifest.files}
    found = {n for n in os.listdir(tmp) if (tmp / n).is_file()}
    named = {info.relative_path for info in (read_dcp_metadata(tmp).storage_data or {}).values()}
    unseen, unknown, unnamed = sorted(listed - found), sorted(found - listed), sorted(named - listed)
    if unseen or unknown or unnamed:
        raise CheckpointWriteError(
            f"the sharded checkpoint folder {str(tmp)!r} does not hold what the ranks wrote: missing on rank 0 "
            f"{preview(unseen)}, not reported {preview(unknown)}, named by .metadata but not written "
            f"{preview(unnamed)}; every rank must write into one folder on a filesystem they all share"
        )
    atomic_write(tmp / MANIFEST, lambda f: f.write(manifest.to_json()))  # fsyncs the file and the folder
    try:
        commit_folder(tmp, dest)  # a re-save of this step replaces the folder there
    except OSError as err:
        raise write_error(dest, err) from err


@dataclass
class ShardedSave:
    """A sharded save under way: prepared by :func:`begin_sharded`, written and committed by :func:`finish_sharded`."""

    dest: Location
    tmp: Path  # the temporary folder next to dest; on an object store, this rank's local staging folder
    state: dict[str, Any]  # the DCP state: this rank's shards
    mesh: tuple[tuple[int, ...] | None, tuple[str, ...] | None]
    step: int | None
    epoch: int | None
    started: float = field(default_factory=time.perf_counter)  # when the save began, for its log line
    how: str = ""  # what the log line adds after the time (", in the background")

    def staged(self) -> ShardedSave:
        """The same save holding private CPU copies of this rank's shards: training may go on meanwhile. Local."""
        return dataclasses.replace(self, state=map_tensors(self.state, _cpu_copy))


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A private CPU copy; a DTensor stays a DTensor of its mesh and placements with a CPU local tensor (as torch's own
    staging makes it: ``DTensor.from_local`` would move the copy back to the mesh's device)."""
    return t.detach().to("cpu", copy=True)


def _cleanup(save_tmp: Path, dest: Location) -> None:
    if isinstance(dest, RemotePath):  # every rank staged its own files
        drop_staging(save_tmp)
    elif dist.get_rank() == 0 and os.path.lexists(save_tmp):  # failed: nothing was committed
        remove_path(save_tmp)


def begin_sharded(
    path: Location,
    build: Build,
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    started: float | None = None,
) -> ShardedSave:
    """Steps 1 and 2 of a sharded save (see the module): the temporary folder, every rank's payload, the train
    state. Collective (the default group). On failure every rank raises and the folder is gone. On an object store
    each rank stages its files in a local folder instead (:mod:`.sharded_remote`)."""
    return _begin(path, lambda: split_payload(_payload(build)), model, step=step, epoch=epoch, started=started)


def begin_sharded_from(
    path: Location,
    states: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    group: Any = None,
) -> ShardedSave:
    """:func:`begin_sharded` of a payload split already: ``states()`` gives this rank's DCP state (DTensor leaves) and
    the train state (rank 0's is written), as an FSDP2 snapshot holds them. Collective on ``group`` (a group of every
    rank; None: the default one)."""

    def checked() -> tuple[dict[str, Any], dict[str, Any]]:
        _need_numpy()
        return states()

    return _begin(path, checked, model, step=step, epoch=epoch, started=None, group=group)


def _begin(
    path: Location,
    states: Callable[[], tuple[dict[str, Any], dict[str, Any]]],
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    started: float | None,
    group: Any = None,
) -> ShardedSave:
    dest = path
    if dest.suffix in CHECKPOINT_SUFFIXES:
        raise UsageError(
            f"an FSDP2 model saves a sharded checkpoint, which is a folder, but {str(dest)!r} is named like a file",
            hint=f"give a folder name (e.g. {dest.stem}.dcp), or pass full_state=True for one ordinary torch file",
        )
    if isinstance(dest, RemotePath):
        run_on_rank0(lambda: clear_destination(dest), task=f"clear {str(dest)!r}", group=group)
        tmp = local_staging(dest)
    else:
        tmp = run_on_rank0(lambda: make_temp_folder(dest), task=f"create the folder for {str(dest)!r}", group=group)
    rank = dist.get_rank()
    error: BaseException | None = None
    state: dict[str, Any] = {}
    try:
        state, train_state = states()
        if not tmp.is_dir():
            raise CheckpointWriteError(
                f"rank {rank} does not see the folder {str(tmp)!r} rank 0 created; a sharded checkpoint is written "
                "by every rank into one folder: save to a filesystem every rank shares, or pass full_state=True"
            )
        if rank == 0:
            atomic_write(tmp / TRAIN_STATE, lambda f: torch.save(train_state, f))
    except Exception as err:
        error = err
    try:
        agree_step(error, None, "preparing the save", dest, group)
    except BaseException:
        _cleanup(tmp, dest)
        raise
    began = time.perf_counter() if started is None else started
    return ShardedSave(dest, tmp, state, _mesh_of(model), step, epoch, began)


def finish_sharded(save: ShardedSave, group: Any = None) -> Location:
    """Steps 3 to 5 of a sharded save (see the module): every rank's shards, the manifest, the rename. Collective
    on ``group`` (a process group of every rank; None: the default one). On failure every rank raises the same
    :class:`CheckpointWriteError` and the temporary folder is gone."""
    try:
        return _finish(save, dist.get_rank(), group)
    finally:
        _cleanup(save.tmp, save.dest)


def _finish(save: ShardedSave, rank: int, group: Any) -> Location:
    error: BaseException | None = None
    try:
        files = _own_files(save.tmp, rank, train_state=rank == 0) if _dcp_write(save.tmp, save.state, group) else []
        if isinstance(save.dest, RemotePath):
            upload_own(save.tmp, save.dest, files)
    except Exception as err:
        error, files = err, []
    reports = agree_step(error, files, "writing the shards", save.dest, group)
    entries = [e for r in reports for e in r]
    world = dist.get_world_size(group)
    manifest = new_manifest(
        entries, list(save.state), step=save.step, epoch=save.epoch, world_size=world, mesh=save.mesh
    )
    dest = save.dest
    if isinstance(dest, RemotePath):
        run_on_rank0(lambda: commit_remote(save.tmp, dest, manifest), task=f"commit {str(dest)!r}", group=group)
    else:
        run_on_rank0(lambda: _commit(save.tmp, dest, manifest), task=f"commit {str(dest)!r}", group=group)
    seconds = time.perf_counter() - save.started
    log_saved(dest, step=save.step, epoch=save.epoch, size=manifest.size, seconds=seconds, how=save.how)
    return dest


def save_sharded(
    path: Location,
    build: Build,
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    started: float | None = None,
) -> Location:
    """Write the sharded checkpoint folder ``path`` from every rank's shards; return its path (see the module).

    Collective: call it on every rank. ``build()`` runs on every rank (DTensor leaves everywhere; rank 0's
    payload holds the gathered RNG and sampler states). Raises the same :class:`CheckpointWriteError` on every
    rank when any rank fails, and leaves no folder behind. Rank 0 logs the save's line, its time counted from
    ``started`` (a ``time.perf_counter()``; this call's start when None), its size the folder's total.
    """
    return finish_sharded(begin_sharded(path, build, model, step=step, epoch=epoch, started=started))
