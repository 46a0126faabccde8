"""How a run starts from a checkpoint folder: a snapshot in memory, its newest checkpoint, another run's checkpoint
(:mod:`.init_from`), or fresh.

:meth:`CheckpointManager.resume` is the public face; this module holds its decision, so that ``manager.py`` stays free
of ``restore``'s imports.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import logging
import time
from collections.abc import Callable
from pathlib import Path

from .._checkpoint.objects import LiveObjects
from .._checkpoint.options import ResumeOptions
from .._checkpoint.restore import ResumeResult, restore_from
from .._core.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    NotACheckpointError,
    StateMismatchError,
)
from .._core.location import Location, RemotePath
from .._core.log import log_rank0, shown_path
from .._core.text import preview
from .._core.types import PathLike
from .._dist.comm import run_on_rank0
from .._dist.env import is_distributed
from .._foreign.folders import checkpoint_subfolders, foreign_kind, unrecognised_folder
from .._shm import read_identity
from .._source.consensus import confirm_choice
from .._source.integrity import CheckpointInfo
from .._source.listing import numbered_checkpoints
from .._source.source import Source
from .._state.sharded import is_sharded
from .._store.url import location
from .init_from import loose_checkpoints, start_from
from .lock import remove_new_folder
from .newest import choose_for_resume, reads_striped
from .snapshots import MemoryChoice, MemoryTier, choose_snapshot, forget_stale

__all__ = ["FolderState", "folder_state", "start_run"]


class FolderState(enum.Enum):
    """What rank 0 finds in a checkpoint folder."""

    HOLDS_CHECKPOINTS = "holds checkpoints"  # files named ckpt_<step>.pt, valid or not
    NONE_YET = "none yet"  # no such file, or no folder yet under an existing parent


def folder_state(folder: Location) -> tuple[FolderState, list[tuple[int, Location]]]:
    """Whether ``folder`` holds files named like checkpoints, and those files (step, path), oldest first.
    Local (rank 0 calls it for everyone).

    A missing folder whose parent exists is a first run (the manager creates it to take its lock);
    a missing parent is a mistyped path and raises :class:`CheckpointNotFoundError`. On an object store a prefix
    with nothing under it is a first run, and a missing bucket the mistyped path.
    """
    if isinstance(folder, RemotePath) and not folder.exists():
        bucket = folder.bucket
        if bucket is not None and not bucket.exists():
            raise CheckpointNotFoundError(
                f"checkpoint folder {str(folder)!r} is in the bucket {str(bucket)!r}, which does not exist (or these "
                "credentials cannot see it): create the bucket for a first run, or fix the URL"
            )
        return FolderState.NONE_YET, []
    if not folder.exists():
        parent = folder.absolute().parent
        if not parent.is_dir():
            raise CheckpointNotFoundError(
                f"checkpoint folder {str(folder)!r} does not exist, and neither does its parent {str(parent)!r}: "
                "a mistyped path would quietly start from step 0, so this is an error; create the parent "
                "folder for a first run, or fix the path"
            )
        _warn_near_miss(folder, parent)
        return FolderState.NONE_YET, []
    if not folder.is_dir():  # not a FileNotFoundError: code that starts fresh on one must not swallow this
        raise NotACheckpointError(
            f"checkpoint folder {str(folder)!r} is a file, not a folder: a CheckpointManager saves numbered "
            f"checkpoints into a folder of its own. {_adopt_advice(folder)}"
        )
    numbered = numbered_checkpoints(folder)
    if numbered:
        return FolderState.HOLDS_CHECKPOINTS, numbered
    kind = foreign_kind(folder)
    if kind is not None:  # starting fresh here would drop that run
        raise NotACheckpointError(
            f"checkpoint folder {str(folder)!r} holds no ckpt_<step>.pt: it is itself a checkpoint (layout "
            f"{kind.value!r}), and a CheckpointManager saves into a folder of its own. {_adopt_advice(folder)}"
        )
    if checkpoint_subfolders(folder):
        raise NotACheckpointError(
            f"checkpoint folder {str(folder)!r} holds no ckpt_<step>.pt: {unrecognised_folder(folder)}; a "
            "CheckpointManager saves into a folder of its own: give it a new folder, and pass that checkpoint as "
            "init_from= to start a new run from its weights, or run `dist-resume convert CHECKPOINT --into FOLDER` "
            "to continue its run at its step"
        )
    return FolderState.NONE_YET, []


def _adopt_advice(checkpoint: Location) -> str:
    """What to do with another run's checkpoint given where a ``CheckpointManager`` folder belongs."""
    return (
        f"To start a new run from its weights, pass it as init_from={str(checkpoint)!r} with a new folder; to "
        f"continue its run at its step, write it into a new folder as that folder's checkpoint: "
        f"`dist-resume convert {checkpoint} --into NEW_FOLDER`"
    )


def _warn_loose(folder: Location) -> None:
    """Say at WARNING, before a fresh start, which checkpoint files of another run ``folder`` holds (nanoGPT's
    ``out/ckpt.pt``): the manager reads ``ckpt_<step>.pt`` only, and would quietly start from step 0 beside them."""
    loose = loose_checkpoints(folder)
    if not loose:
        return
    first = str(loose[0])
    log_rank0(
        logging.WARNING,
        "checkpoint folder %s holds no ckpt_<step>.pt but holds %s, which CheckpointManager.resume does not read; "
        "starting fresh. To start a new run from its weights pass init_from=%r; to continue its run at its step "
        "write it into this folder as its checkpoint first: dist-resume convert %s --into %s",
        folder,
        preview((str(p) for p in loose), 4, quote=False),
        first,
        first,
        folder,
    )


def _warn_near_miss(folder: Location, parent: Location) -> None:
    """Say at WARNING (printed even without logging set up) when a folder next to the missing ``folder``, named
    almost like it, holds checkpoints: a mistyped path would otherwise start from step 0 with one INFO line."""
    try:
        names = [entry.name for entry in parent.iterdir() if entry.is_dir() and entry.name != folder.name]
    except OSError:
        return
    for name in difflib.get_close_matches(folder.name, names, n=3, cutoff=0.75):
        numbered = numbered_checkpoints(parent / name)
        if numbered:
            log_rank0(
                logging.WARNING,
                "checkpoint folder %s does not exist, but %s next to it holds checkpoints (newest: %s): if that is "
                "the run to continue, fix the path; starting fresh in %s",
                folder,
                parent / name,
                numbered[-1][1].name,
                folder,
            )
            return


def start_run(
    folder: Location,
    objects: LiveObjects,
    options: ResumeOptions,
    *,
    init_from: PathLike | None,
    take_lock: Callable[[], None],
    memory: MemoryTier | None = None,
) -> ResumeResult | None:
    """The body of :meth:`CheckpointManager.resume` (see there). Collective under torch.distributed.

    In one step, rank 0 lists the folder, takes its write lock (``take_lock``: a second job on the folder is
    refused here, before it reads a checkpoint or trains) and chooses the newest complete checkpoint; every
    rank then confirms it sees that file, unless only rank 0 reads (``broadcast_from_rank0``). With ``memory``, a
    snapshot in shared memory at least as new as that checkpoint, which can restore every rank, is taken instead
    (:func:`~dist_resume._manager.snapshots.choose_snapshot`); snapshots older than the folder's newest are freed. A
    snapshot at least as new as the folder's newest *name* is chosen before any checkpoint file is read (a restart
    from memory never reads the folder's newest checkpoint to check it: on a slow store that is the whole state);
    only when there is none does rank 0 check the folder's checkpoints, and then a snapshot newer than the newest
    complete one (the newest names were damaged) is still taken.
    """

    started = time.perf_counter()
    created = False  # rank 0: this resume created the folder (to take its lock)

    listed: list[tuple[int, Location]] = []  # rank 0: the folder's checkpoints by name, listed once

    def look_and_lock() -> int | None:
        """Rank 0: the folder listed and its lock taken; the newest step its names say (None: no checkpoint)."""
        nonlocal created
        state, numbered = folder_state(folder)
        new = isinstance(folder, Path) and not folder.exists()
        take_lock()
        created = new
        if state is FolderState.HOLDS_CHECKPOINTS:
            listed.extend(numbered)
            return max(step for step, _ in numbered)
        if init_from is None:
            _warn_loose(folder)
        return None

    def look_lock_choose() -> CheckpointInfo | None:
        return None if look_and_lock() is None else choose_for_resume(folder, listed, striped=striped)

    def look_lock_identify() -> tuple[int | None, str | None]:
        """Rank 0, with snapshots to look at: :func:`look_and_lock`, and the identity the folder keeps."""
        return look_and_lock(), read_identity(folder)

    def from_memory(choice: MemoryChoice) -> ResumeResult | None:
        if choice.sharded:  # each rank its own shards, from its own node
            source = Source.own_shards(choice.path)
        else:
            source = Source.at(choice.path, None, broadcast=broadcast or choice.broadcast)
        # every rank, before anything changed: a snapshot whose content the plan refuses, or FSDP2 shards of another
        # mesh or sharding, give way to the folder
        refused = (CheckpointCorruptError, StateMismatchError) if choice.sharded else (CheckpointCorruptError,)
        try:
            result = restore_from(source, objects, options, started=started)
        except refused as err:
            log_rank0(
                logging.WARNING,
                "the snapshot of step %d in shared memory cannot be resumed (%s): resuming from the folder",
                choice.step,
                err,
            )
            return None
        memory.resumed_from(choice, objects)  # type: ignore[union-attr]
        return dataclasses.replace(result, source="memory")

    broadcast = options.broadcast_from_rank0 and is_distributed()
    striped = reads_striped(folder, options, broadcast=broadcast)  # then rank 0 reads no tensor record to choose
    try:
        sharded = objects.model is not None and is_sharded(objects.model)
        chosen: CheckpointInfo | None
        if memory is None:
            chosen = run_on_rank0(look_lock_choose, fallback=CheckpointError, task="look at the checkpoint folder")
        else:
            named, identity = run_on_rank0(
                look_lock_identify, fallback=CheckpointError, task="look at the checkpoint folder"
            )
            choice = choose_snapshot(folder, named, identity, sharded=sharded)
            resumed = None if choice is None else from_memory(choice)
            if resumed is not None:
                return resumed
            chosen = None
            if named is not None:
                chosen = run_on_rank0(
                    lambda: choose_for_resume(folder, listed, striped=striped),
                    fallback=CheckpointError,
                    task="choose the checkpoint",
                )
                if chosen.step is not None and chosen.step < named:  # the newest names were damaged or incomplete
                    choice = choose_snapshot(folder, chosen.step, identity, sharded=sharded)
                    resumed = None if choice is None else from_memory(choice)
                    if resumed is not None:
                        return resumed
            forget_stale(folder, None if chosen is None else chosen.step, identity)
        if chosen is not None:
            path = chosen.path if broadcast else confirm_choice(folder, chosen)
            source = Source.newest(path, folder, chosen.layout, broadcast=broadcast)
            return restore_from(source, objects, options, started=started)
        if init_from is None:
            log_rank0(logging.INFO, "no checkpoint in %s: starting fresh", shown_path(folder))
            return None
        return start_from(location(init_from), folder, objects, options, broadcast=broadcast)
    except BaseException:
        if created and isinstance(folder, Path):  # a failed first start leaves no folder behind (lock held still)
            remove_new_folder(folder)
        raise
