"""The memory tier of a checkpoint folder: snapshots in the node's shared memory, a restart resumed from them, and their
copy into the folder.

:meth:`CheckpointManager.snapshot` is the public face (:mod:`.tier`). Each node's local rank 0 writes the state and every
rank's RNG streams and data position into the node's shared memory
(:mod:`dist_resume._shm`: double-buffered, complete once its commit record follows its CRC-32), so losing a node
loses no rank's state; under DDP the node's other ranks copy their shares of the replicated state (the same on every
rank) into the same file (:mod:`.split`). ``resume()`` asks :func:`choose_snapshot` (:mod:`.choose`) whether a snapshot newer than the folder's newest
checkpoint can restore every rank; the folder gets a snapshot's bytes, not a second copy from the device, at
``save(step)`` of the same step when the live state is shown unchanged since (:mod:`.evidence`, :mod:`.reuse`; in a
background thread), at ``close()``, and when the process ends otherwise (an
exception, or the SIGTERM with which a preemption or torchrun's restart of the node's workers begins), which keeps the
snapshots for the restart that may follow (:mod:`.exit`).

The stall is one copy: the payload is laid out first as the torch file it becomes (:mod:`.payload`: the structure
pickled with meta stand-ins, the zip's records placed around empty tensor records), then each tensor is copied straight
into its record in the slot's mapping, which every process keeps across snapshots (:mod:`.writer`,
:func:`~dist_resume._shm.begin_copy`).
The CRC-32s (each record's, the file's) and the commit record follow in a background thread (:meth:`MemoryTier.take`):
a snapshot counts only once its record is written, and until then the previous one is the newest. Every later call
that needs it waits for that commit: the next ``snapshot``, ``save``, ``close``, and the exit and SIGTERM handlers.
"""

from .choose import MemoryChoice, choose_snapshot, forget_stale
from .commit import COMMIT_INLINE_BYTES
from .tier import MemoryTier

__all__ = ["MemoryTier", "MemoryChoice", "choose_snapshot", "forget_stale", "COMMIT_INLINE_BYTES"]
