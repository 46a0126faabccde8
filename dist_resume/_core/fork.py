"""A fork waits until no thread holds the interpreter's thread-list lock (CPython before 3.12: gh-112275). Torch-free.

torch's process groups finish each collective on a thread of their own (gloo's workers, checked here; NCCL's watchdog)
and drop the work's Python references there: the thread takes the GIL through pybind11, which first creates a Python
thread state, under the interpreter's thread-list lock (``HEAD_LOCK``) and without the GIL. A fork at that instant
copies the lock held. On CPython before 3.12 (3.11.7 here) the child takes that lock again in
``PyOS_AfterFork_Child``, before it re-initialises it, and hangs there before running a line of Python. The fork that
hits it is a DataLoader creating an epoch's workers right after a collective: a save held at the epoch's end and
written just before the next iterator (``_manager/epoch_end.py``), an epoch-end save, the epoch's last all-reduce.
The rank then waits forever for its first batch while the others wait in DDP's all-reduce
(docs/exact-resume.md#dataloader-workers-that-hang-as-they-start).

The handler below runs in the forking thread, holding the GIL, just before ``fork()``: ``sys._current_frames()`` takes
and releases that lock, so it returns only once the thread holding it has let it go (that thread does not need the
GIL to finish). What is left is the few microseconds between the handler and the fork, where no Python code runs: in
``scripts/fork_after_collective.py``, 35 of 24,000 forks after a DDP step and an object all-gather hung on 2 loaded
cores without it and none of 20,000 with it. Registered once, when ``dist_resume`` is imported, for every fork of the
process (``os.fork``, multiprocessing's fork, a ``subprocess`` with ``preexec_fn``).
"""

from __future__ import annotations

import os
import sys

__all__ = ["wait_for_thread_states"]


def wait_for_thread_states() -> None:
    """Return once no thread holds the interpreter's thread-list lock (taken and released with the GIL held). Local."""
    sys._current_frames()


if sys.version_info < (3, 12) and hasattr(os, "register_at_fork"):
    os.register_at_fork(before=wait_for_thread_states)
