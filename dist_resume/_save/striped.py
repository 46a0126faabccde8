"""Striped save: every DDP rank writes its share of one ordinary torch checkpoint file, at planned offsets.

Rank 0 builds the payload, plans the archive (:func:`~dist_resume._format.striped_archive.plan_archive`: the pickle, the
small records, every record's place, the large ones on 1 MiB boundaries), splits the large replicated records among the
ranks by bytes (:mod:`~dist_resume._save.striped_plan`), creates the temporary file and broadcasts the plan (one small
broadcast). Every rank builds the same payload structure from its own live objects, finds its records' tensors by their
paths, checks them against the plan and writes their bytes into the one temporary file with positional writes,
computing each CRC-32 on the way, then fsyncs (:meth:`StripedSave.write`: local, so an asynchronous save runs it in a
thread). :meth:`StripedSave.finish` gathers every rank's CRCs or error; rank 0 writes the tail (central directory) and
commits the file as :func:`~dist_resume._format.atomic.atomic_write` does. A failure on any rank is the same
:class:`CheckpointWriteError` on every rank, the temporary file is removed and nothing is committed.

The first save into a folder checks that every rank sees it: rank 0 writes a random token into the temporary file,
every rank opens the file by name and reads it back. When some rank cannot, the save (and every later one into that
folder, in this process) is rank 0's alone, said once in an INFO line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
import torch.distributed as dist
from torch import nn

from .._core.errors import CheckpointWriteError
from .._core.log import log_rank0, log_saved
from .._dist.agree import first_failure
from .._dist.comm import Outcome, all_gather_objects, collective_step, run_on_rank0
from .._format.atomic import commit_file, create_temp, discard_temp, not_pickled, write_error
from .._format.striped_archive import ArchivePlan, StorageRecord, cpu_storage, find_tensor, plan_archive, storage_bytes
from .._format.striped_write import write_frame, write_storage, write_tail
from .._format.zip_write import write_all
from .striped_plan import StripePlan, assign_shares, replicated_paths, stripes

__all__ = ["StripedSave", "stripes", "begin_striped", "save_striped", "agree_seen"]

_OPEN_FLAGS: Final = os.O_RDWR | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)

_seen: dict[str, bool] = {}
"""Per folder (absolute path): whether every rank saw rank 0's file there; decided once, by every rank together."""


def _sees(fd: int, token: str) -> bool:
    """Whether the file open as ``fd`` holds ``token`` at its start: this rank sees rank 0's file. Local."""
    try:
        return os.pread(fd, len(token), 0) == token.encode()
    except OSError:
        return False


def _whole_storage(tensor: torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over all of ``tensor``'s storage (the record's bytes), on its device; no copy."""
    out = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return out.set_(tensor.untyped_storage())  # type: ignore[call-overload]


def _mismatch(record: StorageRecord, found: torch.Tensor | None) -> CheckpointWriteError:
    path = "".join(f"[{key!r}]" for key in record.path)
    what = (
        "nothing" if found is None else f"{found.dtype} {tuple(found.shape)} over {found.untyped_storage().nbytes()} B"
    )
    return CheckpointWriteError(
        f"striped save: payload{path} is {record.dtype} {tuple(record.shape)} over {record.nbytes} B on rank 0 but "
        f"{what} on rank {dist.get_rank()}; under DDP every rank must hold the same model and optimizer state "
        "(was the optimizer stepped on some ranks only?); nothing was saved"
    )


@dataclass
class StripedSave:
    """One rank's part of a striped save: its records and their bytes (views of the live storages, or a snapshot),
    the temporary file open for writing, and on rank 0 the archive's plan. Made by :func:`begin_striped`."""

    dest: Path
    temp: Path
    fd: int | None
    items: list[tuple[StorageRecord, torch.Tensor]]
    archive: ArchivePlan | None  # rank 0's
    error: BaseException | None
    step: int | None
    epoch: int | None
    started: float
    how: str = ""
    _crcs: dict[int, int] = field(default_factory=dict)  # storage index -> CRC-32, once written
    _frame: dict[int, int] = field(default_factory=dict)  # rank 0: layout position of a small record -> CRC-32

    def with_data(self, data: list[torch.Tensor], how: str) -> StripedSave:
        """This save with its records' bytes taken from ``data`` (a snapshot, one per item, in order). Local."""
        items = [(record, tensor) for (record, _), tensor in zip(self.items, data)]
        return dataclasses.replace(self, items=items, how=how)

    def write(self) -> None:
        """Write this rank's records (rank 0: the frame too) and fsync. Local; an error is kept for :meth:`finish`."""
        if self.error is not None or self.fd is None:
            return
        try:
            frame = write_frame(self.fd, self.archive) if self.archive is not None else {}
            for record, data in self.items:
                storage = cpu_storage(data)
                self._crcs[record.index] = write_storage(self.fd, storage_bytes(storage), record)
                del storage
            os.fsync(self.fd)
            self._frame = frame
        except OSError as err:
            self.error = write_error(self.dest, err)
        except Exception as err:  # relayed to every rank by finish()
            self.error = err

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def finish(self, group: Any = None) -> Path:
        """Every rank's CRCs (or error) to every rank; rank 0 writes the tail and commits; every rank returns the path
        or raises the same :class:`CheckpointWriteError`. Collective on ``group`` (None: the default group)."""
        rank = dist.get_rank()
        mine = Outcome(value=self._crcs) if self.error is None else Outcome.failed(rank, self.error)
        try:
            with collective_step(f"gathering every rank's share of {str(self.dest)!r}", CheckpointWriteError):
                outcomes: list[Outcome] = all_gather_objects(mine, group=group)
        except CheckpointWriteError:
            self._abandon(rank)
            raise
        what = (
            f"could not write their share of {str(self.dest)!r}: nothing was saved, the previous checkpoint (if any) "
            "is untouched"
        )
        err = first_failure(outcomes, CheckpointWriteError, what)
        if err is not None:
            self._abandon(rank)
            raise err
        if rank != 0:
            self._close()
        crcs: dict[int, int] = {}
        for outcome in outcomes:
            crcs.update(outcome.value)
        result: Path = run_on_rank0(lambda: self._commit(crcs), task="commit the striped checkpoint", group=group)
        return result

    def _abandon(self, rank: int) -> None:
        self._close()
        if rank == 0:
            discard_temp(self.temp)

    def _commit(self, crcs: dict[int, int]) -> Path:
        """Rank 0: the tail, fsync, the rename and the folder's fsync; the log line."""
        assert self.archive is not None and self.fd is not None
        archive = self.archive
        ordered = []
        for position in range(len(archive.layout.records)):
            index = position - archive.first_storage
            ordered.append(crcs[index] if 0 <= index < len(archive.storages) else self._frame[position])
        try:
            size = write_tail(self.fd, archive, ordered)
            os.fsync(self.fd)
            self._close()
            commit_file(self.temp, self.dest)
        except OSError as err:
            self._abandon(0)
            raise write_error(self.dest, err) from err
        log_saved(
            self.dest,
            step=self.step,
            epoch=self.epoch,
            size=size,
            seconds=time.perf_counter() - self.started,
            how=self.how,
        )
        return self.dest


def _plan(
    dest: Path, build: Callable[[], dict[str, Any]], model: nn.Module, check: bool, mine: dict[str, Any]
) -> StripePlan:
    """Rank 0: the payload, the archive's plan, the shares, the temporary file (and the token in it when ``check``)."""
    payload = build()
    try:
        archive = plan_archive(payload)
    except (pickle.PicklingError, TypeError, AttributeError) as err:  # as torch.save of the payload would fail
        raise not_pickled(dest, err) from err
    fixed = sum(len(data) for data in archive.small.values())
    shares = assign_shares(archive.storages, replicated_paths(model), dist.get_world_size(), fixed)
    try:
        fd, temp = create_temp(dest)
    except OSError as err:
        raise write_error(dest, err) from err
    mine.update(payload=payload, archive=archive, fd=fd, temp=temp)
    token = secrets.token_hex(8) if check else None
    try:
        if token is not None:
            write_all(fd, token.encode(), 0)  # inside data.pkl's local header: overwritten by the frame
    except OSError as err:
        os.close(fd)
        discard_temp(temp)
        raise write_error(dest, err) from err
    return StripePlan(str(temp), token, shares)


def agree_seen(dest: Path, fd: int | None, token: str, temp: Path, group: Any = None) -> bool:
    """Whether every rank of ``group`` (None: the default group) sees rank 0's temporary file ``temp`` of ``dest``
    (open here as ``fd``, None where it could not be opened): it holds ``token`` at its start. When not, every rank
    closes ``fd``, rank 0 removes the file and says so once. Collective on ``group``."""
    seen = fd is not None and (dist.get_rank() == 0 or _sees(fd, token))
    everyone = False
    try:
        with collective_step("checking that every rank sees the checkpoint folder", CheckpointWriteError):
            everyone = all(all_gather_objects(seen, group=group))
    finally:
        if not everyone:  # some rank does not see the file, or a peer was lost: this save's file goes
            if fd is not None:
                os.close(fd)
            if dist.get_rank() == 0:
                discard_temp(temp)
    if not everyone:
        log_rank0(
            logging.INFO,
            "saving into %s from rank 0 alone: some rank cannot see the files rank 0 writes there (each rank writes "
            "its share only into a folder every rank sees)",
            dest.parent,
        )
    return everyone


def begin_striped(
    dest: Path,
    build: Callable[[], dict[str, Any]],
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    started: float,
) -> StripedSave | None:
    """Plan a striped save of ``build()``'s payload to ``dest`` and find this rank's records; None when some rank
    cannot see the folder (now or at an earlier save: the caller saves from rank 0). Collective (a broadcast, and
    an all-gather the first time in a folder); raises rank 0's planning error on every rank."""
    rank = dist.get_rank()
    key = os.path.abspath(dest.parent)
    if _seen.get(key) is False:
        return None
    check = key not in _seen
    mine: dict[str, Any] = {}
    stripe: StripePlan = run_on_rank0(lambda: _plan(dest, build, model, check, mine), task="plan the striped save")
    temp = Path(stripe.temp)
    fd: int | None = mine.get("fd")
    error: BaseException | None = None
    if rank != 0:
        try:
            fd = os.open(temp, _OPEN_FLAGS)
        except OSError as err:
            error = write_error(dest, err)
    if stripe.token is not None:
        _seen[key] = agree_seen(dest, fd, stripe.token, temp)
        if not _seen[key]:
            return None
    items: list[tuple[StorageRecord, torch.Tensor]] = []
    try:
        if error is None:
            payload = mine["payload"] if rank == 0 else build()
            for record in stripe.shares[rank]:
                tensor = find_tensor(payload, record.path)
                if tensor is None or not record.describes(tensor):
                    raise _mismatch(record, tensor)
                items.append((record, _whole_storage(tensor)))
    except Exception as err:  # relayed to every rank by finish()
        error = err
    return StripedSave(dest, temp, fd, items, mine.get("archive"), error, step, epoch, started)


def save_striped(
    dest: Path,
    build: Callable[[], dict[str, Any]],
    model: nn.Module,
    *,
    step: int | None,
    epoch: int | None,
    started: float,
) -> Path | None:
    """A striped save, now: every rank writes its share, rank 0 commits; the path on every rank, or None when some
    rank cannot see the folder (the caller saves from rank 0). Collective."""
    save = begin_striped(dest, build, model, step=step, epoch=epoch, started=started)
    if save is None:
        return None
    save.write()
    return save.finish()
