"""One writer per checkpoint folder on an object store: a lease object ``<prefix>/.dist_resume.lease``.

Object stores have no ``flock``. The writer creates the lease with a conditional put (S3's ``If-None-Match: *``:
of two jobs creating it at once, exactly one succeeds), naming itself (host, pid, the process's start time, its
torchrun job and generation: :mod:`~dist_resume._manager.holder`) and an expiry :data:`~.lease_object.LEASE_SECONDS` ahead (:class:`~.lease_object.Lease`); a thread
renews it every :data:`RENEW_SECONDS` while the manager holds it, and :meth:`PrefixLease.release` deletes it, as does
the end of the process (normal, or by an uncaught exception: see :mod:`~dist_resume._core.exit`) for a lease still
held then.

A lease found there is taken over at once when it expired (its holder died on another host or stalled), when it is
damaged, or when :func:`~dist_resume._manager.holder.takeover_reason` says its holder is gone: an earlier generation of
this torchrun job, or a dead process of this host (a relaunch after a SIGKILL, a ``--max-restarts`` restart). Every
takeover and every renewal replaces the object only while it is still the one read (S3's ``If-Match``): of two
relaunches taking over the same dead lease, exactly one succeeds, and a renewal never overwrites a takeover. Any other
holder may be alive: the writer waits up to :func:`wait_seconds` (``DIST_RESUME_LEASE_WAIT``, default
:data:`WAIT_SECONDS`: the lease's lifetime and a renewal) for the lease to be released or to expire, saying so in one
INFO line, then refuses with the same :class:`~dist_resume.errors.CheckpointWriteError` as the local lock, naming the
holder. A lease held by another manager of this very process is refused at once.

Where the store makes no conditional put (see :func:`~dist_resume._store.upload.conditional_put`), the lease is
created after a check that none exists: two jobs starting within the same moment may both take it. That is said once,
at WARNING, and in docs/checkpoint-folders.md.
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
import weakref
from typing import Final

from .._core.errors import CheckpointWriteError, UsageError
from .._core.exit import release_at_exit
from .._core.location import Location, RemotePath
from .._store.upload import conditional_put, put_if_absent, put_if_unchanged, read_tagged
from .holder import Holder, takeover_reason, this_process
from .lease_object import LEASE_SECONDS, Lease
from .lock import FolderLock

__all__ = [
    "LEASE_NAME",
    "RENEW_SECONDS",
    "WAIT_ENV",
    "WAIT_SECONDS",
    "PrefixLease",
    "wait_seconds",
    "writer_lock",
    "lock_for_resume",
]

# the library logger (:mod:`dist_resume._core.log`, which imports torch: this module is read by torch-free commands)
logger = logging.getLogger("dist_resume")

LEASE_NAME: Final = ".dist_resume.lease"
RENEW_SECONDS: Final = 15.0
WAIT_ENV: Final = "DIST_RESUME_LEASE_WAIT"
WAIT_SECONDS: Final = LEASE_SECONDS + RENEW_SECONDS  # a holder that died now: its lease expires within this
POLL_SECONDS: Final = 2.0  # while waiting: how often the lease is looked at
_CHANGES: Final = 10  # a lease that changed this often between a look and a put: another writer keeps replacing it

_HELD: weakref.WeakSet[PrefixLease] = weakref.WeakSet()
_warned_unconditional: set[str] = set()


def _forget_in_child() -> None:
    """In a forked child: the parent holds the leases; the child neither renews nor deletes them."""
    for lease in list(_HELD):
        lease._token = None
        lease._renewer = None
    _HELD.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _release_held() -> None:
    """At exit: delete the leases still held (a script that ended without ``close()``, or by an exception), while
    the store can still be reached; only a process killed without running it leaves its lease to expire."""
    for lease in list(_HELD):
        lease.release()


def wait_seconds() -> float:
    """How long a writer waits for a live-looking lease to be released or to expire: ``$DIST_RESUME_LEASE_WAIT``
    (seconds, 0: refuse at once), else :data:`WAIT_SECONDS`."""
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return WAIT_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise UsageError(
            f"{WAIT_ENV}={text!r} is not a number of seconds >= 0: it bounds how long a job waits for another job's "
            f"write lease on an object store (default {WAIT_SECONDS:.0f})"
        )
    return seconds


class PrefixLease:
    """The write lease of one checkpoint folder on an object store. Local; the same face as
    :class:`~dist_resume._manager.lock.FolderLock` (``acquire``, ``release``, ``held``, ``path``).

    ``wait``: how long :meth:`acquire` waits for a live-looking lease (seconds; None: :func:`wait_seconds`)."""

    def __init__(self, folder: RemotePath, *, wait: float | None = None) -> None:
        if wait is not None and (isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait < 1e9):
            raise ValueError(f"lease_wait must be a number of seconds >= 0 (0: refuse at once), got {wait!r}")
        self.path = folder / LEASE_NAME
        self.wait = wait
        self._token: str | None = None
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._lost: str | None = None  # why the renewing thread found the lease gone

    @property
    def held(self) -> bool:
        return self._token is not None

    def _new(self, since: float | None = None) -> Lease:
        now = time.time()
        assert self._token is not None
        me = this_process()
        return Lease(
            me.host,
            me.pid,
            now if since is None else since,
            now + LEASE_SECONDS,
            self._token,
            me.node,
            me.start,
            me.job,
            me.generation,
        )

    def _read(self) -> tuple[Lease | None, str | None]:
        """The lease there now (None for a damaged one) and its tag (None: no object there at all)."""
        found = read_tagged(self.path)
        if found is None:
            return None, None
        return Lease.from_json(found[0]), found[1]

    def acquire(self) -> None:
        """Take the lease, waiting for a live-looking holder's (see the module), or raise
        :class:`CheckpointWriteError` naming the holder. A lease this manager lost (it stalled past the expiry and
        another job took it) raises too."""
        if self._lost is not None:
            lost, self._lost = self._lost, None
            self._token = None
            raise CheckpointWriteError(
                f"cannot save into checkpoint folder {str(self.path.parent)!r}: this manager lost its lease ({lost}); "
                "another job may be writing there now: stop one of the two, then resume"
            )
        if self._token is not None:
            return
        if not conditional_put(self.path) and self.path.protocol not in _warned_unconditional:
            _warned_unconditional.add(self.path.protocol)
            logger.warning(
                "the %s:// store makes no conditional put through fsspec, so the write lease of %s is created after "
                "a check that none exists: two jobs starting within the same moment may both take it; keep one job "
                "per folder by other means too (the scheduler's job dependencies). See docs/checkpoint-folders.md",
                self.path.protocol,
                self.path.parent,
            )
        bound = wait_seconds() if self.wait is None else self.wait
        self._token = secrets.token_hex(16)
        try:
            self._take(bound)
        except BaseException:
            self._token = None
            raise
        self._stop.clear()
        self._renewer = threading.Thread(
            target=self._renew, name=f"dist_resume-lease-{self.path.parent.name}", daemon=True
        )
        self._renewer.start()
        _HELD.add(self)
        release_at_exit(_release_held)

    def _take(self, bound: float) -> None:
        """Create the lease, take it over from a holder that is gone, or wait up to ``bound`` seconds."""
        folder = str(self.path.parent)
        me = this_process()
        deadline: float | None = None
        changes = 0
        while changes < _CHANGES:
            try:
                mine = self._new().to_json()
                if put_if_absent(self.path, mine):
                    return
                current, tag = self._read()
                if tag is None:
                    changes += 1
                    continue  # released meanwhile: create it
                now = time.time()
                reason = self._takeover(current, now, me)
                if reason is not None:
                    if put_if_unchanged(self.path, mine, tag):
                        logger.info("took over the write lease of %s: %s", folder, reason)
                        return
                    changes += 1
                    continue  # another writer changed it first: judge the new one
            except OSError as err:
                raise CheckpointWriteError(
                    f"cannot take the write lease of checkpoint folder {folder!r} ({self.path}): "
                    f"{type(err).__name__}: {err}; check the credentials and that the bucket exists"
                ) from err
            assert current is not None  # a damaged lease is taken over
            if deadline is None:
                deadline = time.monotonic() + bound
                if bound > 0 and not _mine(current, me):
                    logger.info(
                        "the write lease of %s is held by %s: waiting up to %.0f s (%s) for it to be released or to "
                        "expire",
                        folder,
                        current.describe(now),
                        bound,
                        WAIT_ENV,
                    )
            left = deadline - time.monotonic()
            if left <= 0 or _mine(current, me):
                raise CheckpointWriteError(self._refusal(current, now, me, bound))
            time.sleep(min(POLL_SECONDS, left))
        raise CheckpointWriteError(
            f"cannot take the write lease of checkpoint folder {folder!r}: another writer keeps replacing it; stop "
            "the other writer"
        )

    @staticmethod
    def _takeover(current: Lease | None, now: float, me: Holder) -> str | None:
        """Why the lease there may be replaced at once, or None."""
        if current is None:
            return "the previous one was damaged"
        if current.expires <= now:
            return f"the previous one ({current.holder.describe()}) expired {now - current.expires:.0f} s ago"
        reason = takeover_reason(current.holder, me)
        return None if reason is None else f"the previous one ({current.holder.describe()}) was left behind: {reason}"

    def _refusal(self, current: Lease, now: float, me: Holder, bound: float) -> str:
        folder = str(self.path.parent)
        head = f"cannot save into checkpoint folder {folder!r}: it is leased by {current.describe(now)}"
        if _mine(current, me):
            return (
                f"{head}: another CheckpointManager of this process holds it. One writer per folder: close() that "
                f"manager first, or save into another folder. The lease object is {str(self.path)!r}"
            )
        where = (
            "a live process of this host"
            if me.same_host(current.holder)
            else "a process this host cannot check (another host, or an older dist_resume)"
        )
        return (
            f"{head}: another job is saving into this folder ({where}; waited {bound:.0f} s, {WAIT_ENV}, for it to "
            "be released or to expire). One writer per folder: stop the other writer or save into another folder; "
            "reading (resume, latest_checkpoint) needs no lease. If that job is dead, its lease expires by itself "
            f"within {LEASE_SECONDS:.0f} s of its last renewal: relaunch then, or set {WAIT_ENV} longer. A relaunch "
            "of the same torchrun job, or on the same host after its process died, takes the lease over at once. "
            f"The lease object is {str(self.path)!r}"
        )

    def _renew(self) -> None:
        since = time.time()
        while not self._stop.wait(RENEW_SECONDS):
            token = self._token
            if token is None:
                return
            try:
                current, tag = self._read()
                lost = None
                if current is None or current.token != token:
                    lost = f"replaced by {current.holder.describe()}" if current else "deleted"
                elif tag is None or not put_if_unchanged(self.path, self._new(since).to_json(), tag):
                    lost = "replaced while it was renewed"
                if lost is not None:
                    self._lost = f"its lease object was {lost}"
                    logger.error("lost the write lease of %s: %s", self.path.parent, self._lost)
                    return
            except Exception as err:  # a transient store error: the next round tries again
                logger.log(logging.WARNING, "could not renew the write lease of %s: %s", self.path.parent, err)

    def release(self) -> None:
        """Stop renewing and delete the lease if it is still this manager's (no-op if not held). Local."""
        token, self._token = self._token, None
        _HELD.discard(self)
        self._stop.set()
        if self._renewer is not None and self._renewer is not threading.current_thread():
            self._renewer.join(timeout=5)
        self._renewer = None
        if token is None:
            return
        try:
            current, _ = self._read()
            if current is not None and current.token == token:
                self.path.unlink(missing_ok=True)
        except Exception as err:  # it expires by itself
            logger.warning("could not delete the write lease %s (it expires by itself): %s", self.path, err)


def _mine(lease: Lease, me: Holder) -> bool:
    """Whether ``lease`` is held by this very process (another manager of it): waiting would never end."""
    return me.same_host(lease.holder) and lease.pid == me.pid


def lock_for_resume(lock: FolderLock | PrefixLease) -> None:
    """Take ``lock`` (a manager's, :func:`writer_lock`) for a resume, before anything is read: a second job on the
    folder stops before it trains. Local (rank 0); raises :class:`CheckpointWriteError` naming the holder."""
    try:
        lock.acquire()
    except CheckpointWriteError as err:
        raise CheckpointWriteError(
            f"CheckpointManager.resume() takes the folder's write lock before it reads anything, so that a second job "
            f"on the folder stops before it trains: {err}"
        ) from err


def writer_lock(folder: Location, *, lease_wait: float | None = None) -> FolderLock | PrefixLease:
    """The one-writer guard of ``folder``: ``flock`` on a local folder, a lease on an object store (``lease_wait``:
    see :class:`PrefixLease`). Local."""
    return PrefixLease(folder, wait=lease_wait) if isinstance(folder, RemotePath) else FolderLock(folder)
