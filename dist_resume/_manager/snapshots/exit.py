"""The process ending without ``close()``: at exit, or at a SIGTERM (a preemption notice, torchrun stopping the node's
workers for a restart), each watched tier copies its newest snapshot into its folder and keeps the snapshots.

Only the process that armed it acts (FACTS 43): a child forked from it (a DataLoader's worker, ``multiprocessing``
with fork, ``os.fork``) inherits the SIGTERM handler and the exit hook, and ends as if they were not there (the
handler passes the signal on to the previous one; the tiers watched are forgotten in the child). At SIGTERM the
DataLoader's workers get the signal too (torchrun sends it to each worker's process group), and the DataLoader's
SIGCHLD handler raises "DataLoader worker (pid …) is killed by signal: Terminated" in the main thread when one dies:
so the handler first sets SIGCHLD's handler to the default, and keeps it so while a previous SIGTERM handler (the
script's, coverage's) runs: the workers' deaths from this same notice are no error to raise inside it. The DataLoader's
handler is put back once that handler ends, returned or raised; the DataLoader still finds a dead worker by its own
liveness check. The copy runs in a thread of its own, which the main thread waits for whatever a signal handler raises
in it meanwhile.
"""

from __future__ import annotations

import _thread
import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

from ..._core.exit import release_at_exit
from ..._core.log import logger
from ..folder_save import SaveTarget

__all__ = ["watch", "unwatch", "owner"]


class _Tier(Protocol):
    def at_exit(self, target: SaveTarget) -> None: ...


# the tiers that copy their newest snapshot into their folder if the process ends without close(), and that folder
_watched: weakref.WeakKeyDictionary[_Tier, SaveTarget] = weakref.WeakKeyDictionary()
_previous_sigterm: Any = None
_owner: int | None = None  # the pid of the process that armed the exit hook and the handler


def owner() -> int:
    """The pid of this process: what a tier records when it is made, and compares before acting. Local."""
    return os.getpid()


def _forget_in_child() -> None:
    """In a forked child: the parent's tiers are not the child's to copy."""
    _watched.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def watch(tier: _Tier, target: SaveTarget) -> None:
    """Copy ``tier``'s newest snapshot into the folder if the process ends without ``close()``: at exit, or at a
    SIGTERM (the handler then ends the process as the previous handler would have). Local."""
    global _owner, _previous_sigterm
    _watched[tier] = target
    if _owner == os.getpid():
        return
    _owner = os.getpid()
    release_at_exit(_copy_all_at_exit)
    if threading.current_thread() is threading.main_thread():
        try:
            if signal.getsignal(signal.SIGTERM) is not _on_sigterm:  # a fork that watches anew keeps the one chained
                _previous_sigterm = signal.signal(signal.SIGTERM, _on_sigterm)
        except (ValueError, OSError):  # not the main interpreter, or no signals here
            _previous_sigterm = None


_copy_lock = threading.Lock()  # one copy at a time: a second caller finds the snapshot copied


def _copy_all() -> None:
    with _copy_lock:
        for tier, target in list(_watched.items()):
            tier.at_exit(target)


def _copy_all_at_exit() -> None:
    """Every watched tier's copy, in a thread of its own that the calling thread waits for whatever is raised in it
    meanwhile (a signal handler's exception: the process is ending anyway). Only in the process that armed it."""
    if _owner != os.getpid() or not _watched:
        return
    done = threading.Event()

    def run() -> None:
        try:
            _copy_all()
        finally:
            done.set()

    try:
        _thread.start_new_thread(run, ())
    except RuntimeError:  # no new thread (this late in the interpreter's shutdown): the copy in this one
        run()
        return
    while not done.is_set():
        try:
            done.wait()
        except Exception as err:  # raised by another signal's handler in this thread while it waited
            logger.debug("while the newest snapshot was copied at the end: %s (ignored: the process is ending)", err)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    chld = None
    if _owner == os.getpid():
        # first, before a DataLoader worker that got the same SIGTERM dies: its SIGCHLD handler would raise in here
        chld = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        _copy_all_at_exit()
        _watched.clear()
    previous = _previous_sigterm
    if callable(previous):
        try:
            previous(signum, frame)
        finally:
            if chld is not None:  # the previous handler returned (or raised): the DataLoader's handler is back
                signal.signal(signal.SIGCHLD, chld)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
    os.kill(os.getpid(), signal.SIGTERM)


def unwatch(tier: _Tier) -> None:
    """Forget ``tier``: nothing is copied for it at the end. Local; idempotent."""
    _watched.pop(tier, None)
