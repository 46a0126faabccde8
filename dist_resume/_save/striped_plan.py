"""Who writes what in a striped save: which checkpoints stripe, and each rank's share of the storage records.

Local functions, run on rank 0 (the plan) or on every rank with the same answer (:func:`stripes`). Only what DDP
keeps identical on every rank is spread: the model's parameters (DDP broadcasts them at construction and every rank
applies the same all-reduced gradients) and the optimizer's per-parameter state. Buffers (BatchNorm's running
statistics change in each rank's own forward), the EMA (a script may update it on rank 0 only), ``extra``, the RNG
streams and the data position stay with rank 0, which alone holds the values a rank-0 save would write.
:func:`assign_shares` also splits a snapshot's copy among a node's local ranks (``_manager/snapshots/split.py``), the same
records spread, local rank 0 in rank 0's place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Final, Protocol, TypeVar

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from .._core.location import Location, RemotePath
from .._core.torch_compat.private import compiled_original
from .._format.striped_archive import StorageRecord, TreePath
from .._layout.layout import Key
from .._state.prefix import canonical_key, unwrap_model
from .._state.sharded import is_sharded

__all__ = ["RANK0_ENV", "StripePlan", "Shareable", "stripes", "is_ddp", "replicated_paths", "assign_shares"]

RANK0_ENV: Final = "DIST_RESUME_SAVE_RANK0"
"""Private switch, read once at import: ``1`` makes every save a rank-0 save (tests and the benchmark compare)."""

rank0_only: bool = os.environ.get(RANK0_ENV, "") == "1"


@dataclass(frozen=True, slots=True)
class StripePlan:
    """What rank 0 broadcasts: the temporary file, the token to look for in it (None once every rank is known to see
    the folder) and each rank's storage records, indexed by rank."""

    temp: str
    token: str | None
    shares: tuple[tuple[StorageRecord, ...], ...]


class Shareable(Protocol):
    """A record :func:`assign_shares` places: its position, its first tensor's path, its size, whether it is large."""

    @property
    def index(self) -> int: ...
    @property
    def path(self) -> TreePath: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def large(self) -> bool: ...


_R = TypeVar("_R", bound=Shareable)


def is_ddp(model: nn.Module) -> bool:
    """Whether ``model`` is a DistributedDataParallel (perhaps inside ``torch.compile``). Local."""
    while True:
        if isinstance(model, DistributedDataParallel):
            return True
        inner = compiled_original(model)
        if inner is None:
            return False
        model = inner


def stripes(model: nn.Module | None, dest: Location, world_size: int) -> bool:
    """Whether a save of ``model`` to ``dest`` stripes: a DDP model (not FSDP2-sharded) on more than one rank, saved
    to a local path, the private switch off. Local; the same answer on every rank."""
    return (
        not rank0_only
        and world_size > 1
        and not isinstance(dest, RemotePath)
        and model is not None
        and not is_sharded(model)
        and is_ddp(model)
    )


def replicated_paths(model: nn.Module) -> frozenset[str]:
    """The canonical names of ``model``'s parameters: the model entries every DDP rank holds identically. Local."""
    inner = unwrap_model(model)
    return frozenset(canonical_key(name) for name, _ in inner.named_parameters(remove_duplicate=False))


def _replicated(path: TreePath, parameters: frozenset[str]) -> bool:
    if len(path) >= 2 and path[0] == Key.MODEL:
        return path[1] in parameters
    return len(path) >= 3 and path[0] == Key.OPTIMIZER and path[1] == "state"


def assign_shares(
    storages: tuple[_R, ...], parameters: frozenset[str], world_size: int, fixed: int
) -> tuple[tuple[_R, ...], ...]:
    """Each rank's records (a striped save's storage records, a snapshot's), balanced by bytes: rank 0 starts with
    ``fixed`` bytes (the pickle and the small records) plus every record only it may write; each large replicated record goes, largest first, to the rank with
    the fewest bytes so far (the lowest such rank on a tie). Deterministic. Local.

    Example::

        >>> recs = tuple(StorageRecord(i, ("model", f"w{i}"), torch.float32, (n,), (1,), 0, 4 * n, 0, 0, True)
        ...              for i, n in enumerate([300, 200, 100]))
        >>> [[r.index for r in share] for share in assign_shares(recs, frozenset({"w0", "w1", "w2"}), 2, 0)]
        [[0], [1, 2]]
    """
    shares: list[list[_R]] = [[] for _ in range(world_size)]
    loads = [fixed] + [0] * (world_size - 1)
    spread = []
    for record in storages:
        if record.large and _replicated(record.path, parameters):
            spread.append(record)
        else:
            shares[0].append(record)
            loads[0] += record.nbytes
    for record in sorted(spread, key=lambda r: (-r.nbytes, r.index)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(record)
        loads[rank] += record.nbytes
    return tuple(tuple(sorted(share, key=lambda r: r.index)) for share in shares)
