"""What the toolkit finishes when the interpreter exits, while the stores can still be reached: the background writes
still running (:func:`wait_at_exit`), then the releases (:func:`release_at_exit`). Local; torch-free.

A Python process that ends normally or by an uncaught exception first calls the callbacks registered with
``threading._register_atexit``, the last registered first, ``concurrent.futures``' among them (it shuts down every
thread pool); then joins the non-daemon threads; only then runs ``atexit`` handlers and ``weakref.finalize`` callbacks.
By then an fsspec store that sends its requests through a thread pool (s3fs, through aiobotocore) fails each one with
"cannot schedule new futures after shutdown": the write lease of an object-store folder, deleted from there, stayed
until it expired, and a relaunch was refused for a minute. So this module registers one callback with ``threading``,
after ``concurrent.futures`` registered its own, which therefore runs first. A process killed by a signal it does not
handle (SIGKILL, a SIGTERM without a handler) or ended by ``os._exit`` runs none of it. A child forked from the
process (a DataLoader's worker: FACTS 43) inherits the registration but none of what was registered: what the
parent waits for and releases is the parent's alone, and a child's exit (a worker's ends through ``threading``'s
shutdown) runs only what the child registered itself.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["wait_at_exit", "release_at_exit"]

_writers: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_releases: list[Callable[[], None]] = []
_registered = False


def _forget_in_child() -> None:
    """In a forked child: the parent's background writes and releases are not the child's to run."""
    _writers.clear()
    _releases.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _register() -> None:
    global _registered
    if _registered:
        return
    import concurrent.futures.thread  # noqa: F401  registers its pools' shutdown now, so that ours runs before it

    # a CPython internal (3.9+); where it is missing, atexit is the best left (too late for a thread pool's requests)
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(_at_exit)
    except RuntimeError:  # the interpreter is exiting already: nothing left to register with
        return
    _registered = True


def _at_exit() -> None:
    for thread in list(_writers):
        if thread.is_alive() and thread is not threading.current_thread():
            thread.join()
    for release in reversed(_releases):
        try:
            release()
        except Exception as err:  # one failed release must not keep the others from running
            logging.getLogger("dist_resume").warning("at exit, %s failed: %s", release.__qualname__, err)


def wait_at_exit(thread: threading.Thread) -> None:
    """At exit, wait for ``thread`` (a background write, not a daemon) before any release runs. Local."""
    _writers.add(thread)
    _register()


def release_at_exit(release: Callable[[], None]) -> None:
    """At exit, once the background writes are done, call ``release`` (a module-level function, registered once
    however often it is given; the last registered runs first). Local."""
    if release not in _releases:
        _releases.append(release)
    _register()
