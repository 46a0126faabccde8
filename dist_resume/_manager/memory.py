"""The memory tier of a checkpoint folder: snapshots in the node's shared memory, a restart resumed from them, and their
copy into the folder.

:meth:`CheckpointManager.snapshot` is the public face. Each node's local rank 0 writes the whole state (a DDP model's
is the same on every rank) and every rank's RNG streams and data position into the node's shared memory
(:mod:`dist_resume._memory`: double-buffered, complete once its commit record follows its CRC-32), so losing a node
loses no rank's state. ``resume()`` asks :func:`choose_snapshot` whether a snapshot newer than the folder's newest
checkpoint can restore every rank; the folder gets a snapshot's bytes, not a second copy from the device, at
``save(step)`` of the same step (in a background thread), at ``close()``, and when the process ends otherwise (an
exception, or the SIGTERM with which a preemption or torchrun's restart of the node's workers begins), which keeps the
snapshots for the restart that may follow.

The stall is one copy: the payload is laid out first as the torch file it becomes (:func:`_laid_out`: the structure
pickled with meta stand-ins, the zip's headers placed around empty records), then each tensor is copied straight into
its record in the slot's mapping, which this process keeps across snapshots (:func:`~dist_resume._memory.begin_copy`).
The CRC-32s (each record's, the file's) and the commit record follow in a background thread (:meth:`MemoryTier.take`):
a snapshot counts only once its record is written, and until then the previous one is the newest. Every later call
that needs it waits for that commit: the next ``snapshot``, ``save``, ``close``, and the exit and SIGTERM handlers.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Final

import torch
import torch.distributed as dist

from .._checkpoint.objects import LiveObjects
from .._core import torch_compat
from .._core.errors import CheckpointWriteError, UsageError
from .._core.exit import release_at_exit
from .._core.location import Location
from .._core.log import log_rank0, logger, shown_path, shown_size
from .._core.rank import global_rank
from .._core.tree import iter_tensors, map_tensors
from .._dist.agree import gather_agreed
from .._dist.comm import all_gather_objects, run_on_rank0
from .._dist.env import is_distributed, rank_info
from .._format.archive import ArchiveContents, StorageInfo
from .._format.pickle_write import dump_pickle
from .._format.stream_write import ARCHIVE_NAME, distinct_tensors
from .._format.zip_write import ZipWriter
from .._memory import (
    FileLayout,
    PendingSnapshot,
    Snapshot,
    begin_copy,
    begin_snapshot,
    mark_persisted,
    newest_snapshot,
    persist_snapshot,
    read_layout,
    remove_snapshots,
    size_estimate,
    snapshots,
)
from .._memory.place import required_root, shm_root
from .._save.async_save import wait_pending
from .._save.save import prepare_payload
from .._source.listing import numbered_checkpoints
from .._state.sharded import is_sharded
from .folder_save import SaveTarget

__all__ = ["MemoryTier", "MemoryChoice", "choose_snapshot", "forget_stale", "COMMIT_INLINE_BYTES"]

COMMIT_INLINE_BYTES: Final = 32 << 20
"""A snapshot up to this size is committed before ``snapshot()`` returns (its CRC-32s take a few milliseconds); a
larger one in a background thread."""


class MemoryTier:
    """What one manager's process knows of its folder's snapshots: the newest this process wrote (each node's local
    rank 0 writes), whether the folder holds it, and the copy into the folder running in the background (rank 0)."""

    def __init__(self, folder: Location) -> None:
        self.folder = folder
        self.newest: Snapshot | None = None
        self.used = False  # this process snapshotted or resumed from memory: close() copies and frees
        self._copy: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        self._commit: threading.Thread | None = None  # the newest snapshot's commit, in the background
        self._committing: int | None = None  # its step
        self._commit_error: BaseException | None = None
        self._lock = threading.Lock()

    # --- snapshot ---

    def take(self, target: SaveTarget, live: LiveObjects, step: int, *, epoch: int | None, extra: Any) -> None:
        """The body of :meth:`CheckpointManager.snapshot`. Collective under torch.distributed. Returns once the
        snapshot's data is in shared memory; its commit (the CRC-32s, then the record) follows in a background thread
        unless it is small (:data:`COMMIT_INLINE_BYTES`). The previous snapshot's commit is waited for first, and its
        error is this call's."""
        if live.model is not None and is_sharded(live.model):
            raise UsageError(
                "CheckpointManager.snapshot() keeps a plain or DDP model's state in shared memory; an FSDP2 model's "
                "shards are not snapshotted yet: use save_async(step) for it"
            )
        required_root()  # no shared memory (not Linux): a UsageError on every rank before anything is written
        wait_pending()

        def prepare() -> None:  # rank 0: the previous copy's error first, then the folder's write lock
            self._join_copy()
            target.prepare()

        run_on_rank0(prepare, task="prepare the snapshot")  # a second job on the folder stops here too
        started = time.perf_counter()
        build, saved_epoch = prepare_payload(live, step=step, epoch=epoch, extra=extra, rng=True, everywhere=True)
        error: BaseException | None = None
        if rank_info().local_rank == 0:
            try:
                self._join_commit(raising=True)
                self._commit_later(_begin(self.folder, build(), step, saved_epoch))
            except Exception as err:
                error = err
        if is_distributed():
            gather_agreed(error, what="could not take the snapshot", fallback=CheckpointWriteError)
        if error is not None:
            raise error
        self.used = True
        _watch(self, target)
        logger.debug("snapshot of step %d in %.3f s", step, time.perf_counter() - started)

    # --- the commit ---

    def _commit_later(self, pending: PendingSnapshot) -> None:
        """Commit ``pending`` now when it is small, else in a background thread (its error at the next call)."""
        if pending.size <= COMMIT_INLINE_BYTES:
            self.newest = pending.commit()
            return

        def run() -> None:
            try:
                snapshot = pending.commit()
            except BaseException as err:
                self._commit_error = err
                return
            with self._lock:
                self.newest = snapshot

        self._committing = pending.step
        self._commit = threading.Thread(target=run, name=f"dist_resume-commit-{pending.step}", daemon=False)
        self._commit.start()

    def _join_commit(self, *, raising: bool) -> None:
        """Wait for the snapshot being committed; its error is raised (``raising``) or logged once."""
        thread = self._commit
        if thread is not None:
            thread.join()
            self._commit = self._committing = None
        error, self._commit_error = self._commit_error, None
        if error is None:
            return
        if raising:
            raise CheckpointWriteError(f"committing a snapshot of {str(self.folder)!r} failed: {error}") from error
        logger.warning("committing a snapshot of %s failed: %s", shown_path(self.folder), error)

    # --- the copy into the folder ---

    def copies_step(self, step: int) -> bool:
        """On rank 0: whether ``save(step)`` can copy this process's snapshot of ``step`` (committed, or being
        committed) instead of saving again, once the previous copy is done (its error raised here)."""
        self._join_copy()
        if self._committing is not None:
            return self._committing == step
        newest = self.newest
        return newest is not None and newest.step == step

    def copy_in_background(self, target: SaveTarget, dest: Location, step: int) -> None:
        """On rank 0: copy the snapshot of ``step`` into ``dest`` once it is committed, then rotate, in a thread
        (errors at the next call)."""
        commit = self._commit

        def run() -> None:
            try:
                if commit is not None:
                    commit.join()
                snapshot = self.newest
                if snapshot is None or snapshot.step != step:  # its commit failed: that error comes at the next call
                    raise CheckpointWriteError(f"the snapshot of step {step} was not committed; nothing was copied")
                self._copy_now(target, snapshot, dest)
            except BaseException as err:
                self._copy_error = err

        self._copy = threading.Thread(target=run, name=f"dist_resume-copy-{step}", daemon=False)
        self._copy.start()

    def _copy_now(self, target: SaveTarget, snapshot: Snapshot, dest: Location) -> None:
        started = time.perf_counter()
        persist_snapshot(snapshot, dest)
        marked = mark_persisted(snapshot)
        with self._lock:
            if marked is not None and self.newest is not None and self.newest.seq == snapshot.seq:
                self.newest = marked
        log_rank0(
            logging.INFO,
            "saved %s (step %d, %s, copied from shared memory) in %.2f s",
            shown_path(dest),
            snapshot.step,
            shown_size(snapshot.size),
            time.perf_counter() - started,
        )
        target.rotate(dest, snapshot.step)

    def _join_copy(self) -> None:
        thread, self._copy = self._copy, None
        if thread is not None:
            thread.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise CheckpointWriteError(f"copying a snapshot into {str(self.folder)!r} failed: {error}") from error

    def copy_newest(self, target: SaveTarget) -> None:
        """On rank 0: copy this process's newest snapshot (its commit waited for) into the folder unless it holds that
        step already."""
        self._join_commit(raising=False)
        self._join_copy()
        snapshot = self.newest
        if snapshot is None or snapshot.persisted:
            return
        newest_saved = max((s for s, _ in numbered_checkpoints(target.folder)), default=None)
        if newest_saved is not None and newest_saved >= snapshot.step:
            return
        self._copy_now(target, snapshot, target.file(snapshot.step))

    # --- the end ---

    def close(self, target: SaveTarget) -> None:
        """Collective: copy the newest snapshot into the folder (rank 0), then free every node's shared memory."""
        if not self.used:
            return
        run_on_rank0(lambda: self.copy_newest(target), fallback=CheckpointWriteError, task="copy a snapshot")
        if rank_info().local_rank == 0:
            self._join_commit(raising=False)  # no record may follow the removal
            remove_snapshots(self.folder)
        self.newest = None
        self.used = False
        _watched.pop(self, None)

    def resumed_from(self, choice: MemoryChoice) -> None:
        """After a resume from ``choice``: this node's copy is the newest snapshot (close() copies it into the folder if
        the folder does not hold its step; :meth:`watch` arms the same at an unplanned end). Local."""
        if rank_info().local_rank == 0 and choice.own is not None:
            self.newest = choice.own
        self.used = True

    def watch(self, target: SaveTarget) -> None:
        """Copy the newest snapshot into the folder if the process ends without ``close()`` (rank 0). Local."""
        if self.used:
            _watch(self, target)

    def leave(self, target: SaveTarget) -> None:
        """Local, at an error that ends a ``with`` block (perhaps on this rank alone): :meth:`at_exit`, then forget the
        snapshots without freeing them, so that ``close()`` makes no collective call for them."""
        self.at_exit(target)
        self.newest = None
        self.used = False
        _watched.pop(self, None)

    def at_exit(self, target: SaveTarget) -> None:
        """Local, at an unplanned end (exception, SIGTERM, no close()): each node's local rank 0 finishes the commit
        under way, rank 0 copies its newest snapshot into the folder; the snapshots stay, for the restart that may
        follow."""
        if not self.used:
            return
        if rank_info().local_rank == 0:
            self._join_commit(raising=False)
        if global_rank() != 0:
            return
        try:
            self.copy_newest(target)
        except Exception as err:
            logger.warning("at exit, copying the newest snapshot into %s failed: %s", shown_path(self.folder), err)


def _begin(folder: Location, payload: dict[str, Any], step: int, epoch: int | None) -> PendingSnapshot:
    world_size = dist.get_world_size() if is_distributed() else 1
    metadata = {"world_size": world_size, "epoch": epoch}
    laid_out = _laid_out(payload)
    if laid_out is not None:
        layout, spans = laid_out
        return begin_copy(folder, step, layout, lambda mm: _copy_into(mm, spans), metadata=metadata)
    tensors = list(iter_tensors(payload))  # a tensor the copy cannot take: torch.save into a new file
    size = size_estimate(sum(t.untyped_storage().nbytes() for t in tensors), len(tensors))
    return begin_snapshot(folder, step, lambda f: torch.save(payload, f), size_hint=size, metadata=metadata)


def _copyable(tensor: torch.Tensor) -> bool:
    """Whether the copy takes ``tensor`` as torch.save would: a plain strided tensor with its data."""
    return (
        type(tensor) is torch.Tensor
        and tensor.layout == torch.strided
        and not tensor.is_quantized
        and not tensor.is_nested
        and tensor.device.type != "meta"
    )


def _laid_out(payload: dict[str, Any]) -> tuple[FileLayout, list[tuple[int, torch.Tensor]]] | None:
    """``payload`` laid out as the torch file :func:`~dist_resume._format.stream_write.write_streamed` writes (every
    tensor one contiguous CPU record, in walk order), and where each tensor's data goes; None when a tensor cannot be
    copied raw (a subclass, a sparse or meta tensor, one inside a container the walker does not enter)."""
    tensors = distinct_tensors(payload)
    found = {id(t) for t in tensors}
    if not all(map(_copyable, tensors)) or any(id(t) not in found for t in iter_tensors(payload)):
        return None
    contents = ArchiveContents(Path(), ARCHIVE_NAME, [], 0, None, {})
    stand_ins: dict[int, torch.Tensor] = {}
    for i, tensor in enumerate(tensors):
        meta = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device="meta")
        cls, storage_dtype = torch_compat.storage_class_for(tensor.dtype)
        nbytes = tensor.numel() * tensor.element_size()
        numel = nbytes // storage_dtype.itemsize
        contents.register(
            meta.untyped_storage(),
            StorageInfo(str(i), storage_dtype, "cpu", numel, nbytes, ("storage", cls, str(i), "cpu", numel)),
        )
        stand_ins[id(tensor)] = meta
    pickled = dump_pickle(map_tensors(payload, lambda t: stand_ins[id(t)]), contents)
    regions: dict[str, tuple[int, int]] = {}
    fd = os.memfd_create("dist_resume-layout", os.MFD_CLOEXEC)  # sparse: the records' data are never written
    try:
        writer = ZipWriter(fd)
        writer.add_bytes(f"{ARCHIVE_NAME}/data.pkl", pickled)  # the records and their order: write_streamed's
        writer.add_bytes(f"{ARCHIVE_NAME}/.format_version", b"1")
        writer.add_bytes(f"{ARCHIVE_NAME}/.storage_alignment", b"64")
        writer.add_bytes(f"{ARCHIVE_NAME}/byteorder", b"little")
        for i, tensor in enumerate(tensors):
            name, nbytes = f"{ARCHIVE_NAME}/data/{i}", tensor.numel() * tensor.element_size()

            def place(offset: int, name: str = name, nbytes: int = nbytes) -> int:
                regions[name] = (offset, nbytes)
                return 0  # the CRC-32 is written when the commit seals the file

            writer.add_streamed(name, size=nbytes, fill=place)
        writer.add_bytes(f"{ARCHIVE_NAME}/version", b"3\n")
        writer.add_bytes(f"{ARCHIVE_NAME}/.data/serialization_id", str(secrets.randbits(128)).zfill(40).encode())
        layout = read_layout(fd, writer.finish(), regions)
    finally:
        os.close(fd)
    spans = [(regions[f"{ARCHIVE_NAME}/data/{i}"][0], t) for i, t in enumerate(tensors)]
    return layout, spans


def _copy_into(mm: mmap.mmap, spans: list[tuple[int, torch.Tensor]]) -> None:
    """Copy each tensor into its record in the slot's mapping ``mm``: the snapshot's one pass over the data."""
    dest = torch.frombuffer(mm, dtype=torch.uint8)
    try:
        with torch.no_grad():
            for offset, tensor in spans:
                nbytes = tensor.numel() * tensor.element_size()
                if nbytes:
                    dest[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(tensor)
    finally:
        del dest  # the mapping's buffer is released with it


# --- resume ---


@dataclass(frozen=True)
class MemoryChoice:
    """The snapshot every rank resumes from: its step, the file this rank reads (rank 0's under ``broadcast``: rank 0's
    node holds it and another does not, so rank 0 reads and sends), this rank's own copy if its node holds it, and
    whether rank 0 sends it."""

    step: int
    path: Location
    own: Snapshot | None
    broadcast: bool


def choose_snapshot(folder: Location, folder_step: int | None) -> MemoryChoice | None:
    """The newest snapshot of ``folder`` that can restore every rank and is at least as new as the folder's newest
    checkpoint (``folder_step``), or None. Collective under torch.distributed (one all-gather).

    Every rank lists its node's complete snapshots (CRC-32 checked); a step every rank holds is read by every rank from
    its own node, a step only rank 0's node holds is read by rank 0 and broadcast (a node replaced). A damaged snapshot
    is never chosen (one WARNING)."""
    mine = _complete_steps(folder)
    everyone: list[dict[int, Snapshot]] = all_gather_objects(mine) if is_distributed() else [mine]
    floor = -1 if folder_step is None else folder_step
    everywhere = set(everyone[0]).intersection(*everyone[1:])
    on_rank0 = set(everyone[0])
    best = max((s for s in everywhere if s >= floor), default=None)
    sent = max((s for s in on_rank0 if s >= floor), default=None)
    if sent is not None and (best is None or sent > best):
        return MemoryChoice(sent, everyone[0][sent].path, mine.get(sent), broadcast=is_distributed())
    if best is None:
        if any(s > floor for held in everyone for s in held):
            log_rank0(
                logging.WARNING,
                "shared memory holds a snapshot of %s newer than its newest checkpoint, but not on rank 0's node nor on "
                "every node: resuming from the folder",
                shown_path(folder),
            )
        return None
    return MemoryChoice(best, mine[best].path, mine[best], broadcast=False)


def _complete_steps(folder: Location) -> dict[int, Snapshot]:
    """This node's newest complete snapshot of ``folder`` by its step (CRC-32 checked: a damaged one gives way to the
    other slot's, with one WARNING); ``{}`` without shared memory."""
    newest = newest_snapshot(folder, verify=True) if shm_root() is not None else None
    return {} if newest is None else {newest.step: newest}


def forget_stale(folder: Location) -> None:
    """After a resume that took no snapshot, every node's local rank 0 frees the snapshots it no longer needs (none is
    newer than the folder's newest checkpoint). Local."""
    if rank_info().local_rank == 0 and shm_root() is not None and snapshots(folder):
        remove_snapshots(folder)


# --- the process ending without close() ---

# the tiers that copy their newest snapshot into their folder if the process ends without close(), and that folder
_watched: weakref.WeakKeyDictionary[MemoryTier, SaveTarget] = weakref.WeakKeyDictionary()
_previous_sigterm: Any = None
_watching = False


def _watch(tier: MemoryTier, target: SaveTarget) -> None:
    """Copy ``tier``'s newest snapshot into the folder if the process ends without ``close()``: at exit, or at a
    SIGTERM (the handler then ends the process as the previous handler would have). Local."""
    global _watching, _previous_sigterm
    _watched[tier] = target
    if _watching:
        return
    _watching = True
    release_at_exit(_copy_all_at_exit)
    if threading.current_thread() is threading.main_thread():
        try:
            _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            _previous_sigterm = None


def _copy_all_at_exit() -> None:
    for tier, target in list(_watched.items()):
        tier.at_exit(target)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    _copy_all_at_exit()
    _watched.clear()
    previous = _previous_sigterm
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    os.kill(os.getpid(), signal.SIGTERM)
