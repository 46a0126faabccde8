"""The process ending without ``close()``: at exit, or at a SIGTERM (a preemption notice, torchrun stopping the node's
workers for a restart), each watched tier copies its newest snapshot into its folder and keeps the snapshots."""

from __future__ import annotations

import os
import signal
import threading
import weakref
from types import FrameType
from typing import Any, Protocol

from ..._core.exit import release_at_exit
from ..folder_save import SaveTarget

__all__ = ["watch", "unwatch"]


class _Tier(Protocol):
    def at_exit(self, target: SaveTarget) -> None: ...


# the tiers that copy their newest snapshot into their folder if the process ends without close(), and that folder
_watched: weakref.WeakKeyDictionary[_Tier, SaveTarget] = weakref.WeakKeyDictionary()
_previous_sigterm: Any = None
_watching = False


def watch(tier: _Tier, target: SaveTarget) -> None:
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


def unwatch(tier: _Tier) -> None:
    """Forget ``tier``: nothing is copied for it at the end. Local; idempotent."""
    _watched.pop(tier, None)
