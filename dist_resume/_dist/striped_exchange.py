"""Exchanging tensors read in stripes: each rank reads its share of them, every rank receives every share.

:func:`owners_by_bytes` splits tensors (in file order) into one contiguous share per rank, balanced by bytes, the same
on every rank. :func:`exchange` then has each owner read its share (:class:`StripeReader`) straight into its own live
destinations where they can take the bytes in place (a contiguous CPU tensor of the saved dtype), and broadcasts each
share from its owner into every rank's destinations: a tensor of at least :data:`IN_PLACE_BYTES` in place, in pieces of
at most a bucket; smaller ones packed into one bucket of at most ``bucket_bytes``. Held beyond the live tensors: that
bucket (and, on the owner of a tensor whose destination is on an accelerator, one host window of at most a bucket).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import torch
import torch.distributed as dist

from .._core.errors import CheckpointError
from .comm import RESTART_HINT, collective_step, released_by_backend

__all__ = ["IN_PLACE_BYTES", "StripeReader", "Unit", "owners_by_bytes", "exchange"]

IN_PLACE_BYTES: Final = 1 << 20  # a tensor this large is broadcast in place, never packed into the bucket
_ALIGN: Final = 16  # packed tensors start on this boundary, so any dtype views its bytes
_PARTLY: Final = (
    "this rank's model and optimizer may hold part of the checkpoint; the checkpoint file itself is untouched"
)


class StripeReader(Protocol):
    """Where the owners read the saved tensors' data (a checkpoint read by ranges)."""

    def read_bytes(self, tensor: torch.Tensor, start: int, out: torch.Tensor) -> None:
        """Bytes ``[start, start + len(out))`` of the saved tensor's data (contiguous, as saved) into the uint8 CPU
        tensor ``out``."""

    def read_into(self, saved: torch.Tensor, dst: torch.Tensor) -> None:
        """The saved tensor's data into ``dst`` (its shape), as ``dst.copy_`` would."""


@dataclass(frozen=True, slots=True)
class Unit:
    """One saved tensor (``saved``: where its data is read from) and this rank's live destination for it."""

    saved: torch.Tensor
    dst: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.saved.numel() * self.saved.element_size()


@dataclass(frozen=True, slots=True)
class _Piece:
    unit: int
    start: int  # bytes of the unit's data
    length: int
    offset: int  # where it lies in the bucket


@dataclass(frozen=True, slots=True)
class _Message:
    """One broadcast from ``owner``: pieces packed into the bucket, or one piece of one tensor (``alone``)."""

    owner: int
    pieces: tuple[_Piece, ...]
    nbytes: int
    alone: bool


def owners_by_bytes(sizes: Sequence[int], world_size: int) -> list[int]:
    """The rank that owns each of ``sizes`` (bytes, in file order): contiguous shares, one per rank, each item with
    the rank whose share of the total holds its middle byte. Local; the same on every rank for the same sizes."""
    total, before, owners = sum(sizes), 0, []
    for n in sizes:
        owners.append(min(world_size - 1, (2 * before + n) * world_size // (2 * total)) if total else 0)
        before += n
    return owners


def _messages(sizes: Sequence[int], owners: Sequence[int], world_size: int, bucket_bytes: int) -> list[_Message]:
    """The broadcasts that move every item, owner by owner, in file order (the same on every rank)."""
    return [m for rank in range(world_size) for m in _messages_of(rank, sizes, owners, bucket_bytes)]


def _messages_of(rank: int, sizes: Sequence[int], owners: Sequence[int], bucket_bytes: int) -> list[_Message]:
    """``rank``'s broadcasts: each large item alone (in pieces of at most a bucket), the others packed."""
    messages: list[_Message] = []
    packed: list[_Piece] = []
    used = 0
    for i, n in enumerate(sizes):
        if owners[i] != rank or n == 0:
            continue
        if n >= min(IN_PLACE_BYTES, bucket_bytes):
            for start in range(0, n, bucket_bytes):
                length = min(bucket_bytes, n - start)
                messages.append(_Message(rank, (_Piece(i, start, length, 0),), length, alone=True))
            continue
        offset = -(-used // _ALIGN) * _ALIGN
        if offset + n > bucket_bytes:
            messages.append(_Message(rank, tuple(packed), used, alone=False))
            packed, offset = [], 0
        packed.append(_Piece(i, 0, n, offset))
        used = offset + n
    if packed:
        messages.append(_Message(rank, tuple(packed), used, alone=False))
    return messages


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's data."""
    return t.detach().reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def _same_form(unit: Unit) -> bool:
    return unit.dst.is_contiguous() and unit.dst.dtype == unit.saved.dtype and unit.dst.shape == unit.saved.shape


def _read_in_place(unit: Unit) -> bool:
    """Whether the owner reads this unit straight into its destination (a contiguous CPU tensor of the saved form)."""
    return unit.saved.is_contiguous() and unit.dst.device.type == "cpu" and _same_form(unit)


def exchange(
    units: Sequence[Unit],
    reader: StripeReader,
    *,
    bucket_bytes: int,
    device: torch.device,
    what: str = "the checkpoint's tensors",
) -> Exception | None:
    """Move every unit's data into every rank's destination: each rank reads the units it owns
    (:func:`owners_by_bytes`), then broadcasts them on ``device`` (the process group's device for these tensors).
    Collective: every rank passes the same units (the same saved tensors, in the same order; destinations its own).

    A failure on this rank (a short read, a cast) does not stop it taking part: it runs every remaining broadcast and
    returns the first such failure, so that no rank is left waiting (the caller's agreement tells every rank). A lost
    peer raises :class:`CheckpointError`, saying that this rank's live tensors may hold part of the checkpoint.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    sizes = [u.nbytes for u in units]
    owners = owners_by_bytes(sizes, world)
    failure: Exception | None = None
    ready: set[int] = set()  # units whose destination here holds their data already
    with torch.no_grad():
        for i, unit in enumerate(units):  # this rank's share first, read on every rank at once
            if failure is None and owners[i] == rank and sizes[i] and _read_in_place(unit):
                try:
                    reader.read_into(unit.saved, unit.dst)
                    ready.add(i)
                except Exception as err:  # every broadcast still runs; the caller's agreement says why
                    failure = err
        messages = _messages(sizes, owners, world, bucket_bytes)
        direct = [
            m.alone and _same_form(units[m.pieces[0].unit]) and units[m.pieces[0].unit].dst.device == device
            for m in messages
        ]
        need = max((m.nbytes for m, d in zip(messages, direct) if not d), default=0)  # received in place: no bucket
        bucket = torch.empty(need or 1, dtype=torch.uint8, device=device)
        staged: dict[int, torch.Tensor] = {}  # a destination that cannot take the bytes as they come: whole first
        hint = f"{RESTART_HINT} and resume again ({_PARTLY})"
        for n, (message, in_place) in enumerate(zip(messages, direct), 1):
            first = units[message.pieces[0].unit]
            start = message.pieces[0].start
            wire = _flat(first.dst)[start : start + message.nbytes] if in_place else bucket[: message.nbytes]
            if rank == message.owner and failure is None:
                try:
                    _pack(message, wire, in_place, units, ready, reader)
                except Exception as err:
                    failure = err
            verb = "sending" if rank == message.owner else "receiving"
            with collective_step(f"{verb} {what} (broadcast {n} of {len(messages)})", CheckpointError, hint):
                with released_by_backend(wire):
                    dist.broadcast(wire, src=message.owner)
            if failure is None and not in_place:
                try:
                    for piece in message.pieces:
                        if piece.unit not in ready:
                            chunk = wire[piece.offset : piece.offset + piece.length]
                            _write(units[piece.unit], piece, chunk, staged)
                except Exception as err:
                    failure = err
    return failure


def _pack(
    message: _Message,
    wire: torch.Tensor,
    in_place: bool,
    units: Sequence[Unit],
    ready: set[int],
    reader: StripeReader,
) -> None:
    """The owner puts the message's bytes on ``wire``: from its destination where it read them there, else read now
    (through a host window when the wire is on an accelerator)."""
    for piece in message.pieces:
        unit = units[piece.unit]
        target = wire if in_place else wire[piece.offset : piece.offset + piece.length]
        if piece.unit in ready:
            if not in_place:
                target.copy_(_flat(unit.dst)[piece.start : piece.start + piece.length])
        elif target.device.type == "cpu":
            reader.read_bytes(unit.saved, piece.start, target)
        else:
            host = torch.empty(piece.length, dtype=torch.uint8)
            reader.read_bytes(unit.saved, piece.start, host)
            target.copy_(host)


def _write(unit: Unit, piece: _Piece, chunk: torch.Tensor, staged: dict[int, torch.Tensor]) -> None:
    """Bytes ``[piece.start, piece.start + len(chunk))`` of the unit's saved data (contiguous, as saved) into its
    destination (cast to its dtype, moved to its device); a destination that is not contiguous through a whole staging
    tensor, copied once its last piece arrived."""
    saved, dst = unit.saved, unit.dst
    if dst.is_contiguous() and dst.shape == saved.shape:
        if dst.dtype == saved.dtype:
            _flat(dst)[piece.start : piece.start + piece.length].copy_(chunk)
        else:
            size = saved.element_size()
            dst.view(-1)[piece.start // size : (piece.start + piece.length) // size].copy_(chunk.view(saved.dtype))
        return
    whole = staged.get(piece.unit)
    if whole is None:
        whole = staged[piece.unit] = torch.empty(saved.shape, dtype=saved.dtype)
    _flat(whole)[piece.start : piece.start + piece.length].copy_(chunk)
    if piece.start + piece.length == unit.nbytes:
        dst.copy_(staged.pop(piece.unit))
