"""Whether a complete snapshot (its record parsed, its CRC-32 matching) can be resumed: the one place its content is
checked before a resume takes it.

A record is trusted for nothing its data can contradict: the step inside the data must be the record's (a record
claiming step 50 over the data of step 7 would beat the folder's newer checkpoints, and ``close()`` would write the
data under the record's step), and the data must be a checkpoint the resume reads (a file whose CRC-32 matches but
whose content is not one is passed over for the previous snapshot or the folder, never raised). It asks the check
every checkpoint of a folder gets (:func:`~dist_resume._source.integrity.inspect_checkpoint`; an FSDP2 rank's own
shards: :func:`~dist_resume._foreign.own_shards.read_own_shards`), with the CRC-32s already checked.
"""

from __future__ import annotations

from ..._core.errors import DistResumeError
from ..._foreign.own_shards import read_own_shards
from ..._shm import Snapshot
from ..._source.integrity import inspect_checkpoint

__all__ = ["snapshot_problem"]


def snapshot_problem(snapshot: Snapshot, *, shards_of: tuple[int, int] | None = None) -> str | None:
    """Why ``snapshot`` cannot be resumed, or None. ``shards_of``: ``(rank, world size)`` of an FSDP2 rank's own
    shards (None: a whole checkpoint). Local; reads the file's structure, not its tensors; never raises for what the
    file holds."""
    try:
        if shards_of is None:
            step = inspect_checkpoint(snapshot.path, verify=False).step
        else:
            rank, world_size = shards_of
            step = read_own_shards(snapshot.path, rank=rank, world_size=world_size)[0].step
    except DistResumeError as err:
        return f"its data is not a checkpoint a resume reads ({err})"
    if step != snapshot.step:
        return f"its data holds step {step}, its record says {snapshot.step}: the record is not the data's"
    return None
