"""One writer per checkpoint folder on an object store: a lease object ``<prefix>/.dist_resume.lease``.

Object stores have no ``flock``. The writer creates the lease with a conditional put (S3's ``If-None-Match: *``:
of two jobs creating it at once, exactly one succeeds), naming itself (host, pid, since) and an expiry
:data:`LEASE_SECONDS` ahead; a thread renews it every :data:`RENEW_SECONDS` while the manager holds it, and
:meth:`PrefixLease.release` deletes it, as does the end of the process (normal, or by an uncaught exception: see
:mod:`~dist_resume._core.exit`) for a lease still held then. A lease past its expiry is ignored: its holder died
(SIGKILL, preemption) or stalled longer than the lease, and the next writer replaces it. A live one refuses the second
writer with the same :class:`~dist_resume.errors.CheckpointWriteError` as the local lock, naming the holder and when
the lease expires.

Where the store makes no conditional put (see :func:`~dist_resume._store.upload.conditional_put`), the lease is
created after a check that none exists: two jobs starting within the same moment may both take it. That is said once,
at WARNING, and in docs/checkpoint-folders.md.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Final

from .._core.errors import CheckpointWriteError
from .._core.exit import release_at_exit
from .._core.location import Location, RemotePath
from .._store.upload import conditional_put, put_if_absent
from .lock import FolderLock

__all__ = ["LEASE_NAME", "LEASE_SECONDS", "RENEW_SECONDS", "Lease", "PrefixLease", "writer_lock"]

# the library logger (:mod:`dist_resume._core.log`, which imports torch: this module is read by torch-free commands)
logger = logging.getLogger("dist_resume")

LEASE_NAME: Final = ".dist_resume.lease"
LEASE_SECONDS: Final = 60.0
RENEW_SECONDS: Final = 15.0

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


@dataclass(frozen=True)
class Lease:
    """What the lease object says: who holds it, since when, until when, and the holder's token."""

    host: str
    pid: int
    since: float
    expires: float
    token: str

    def to_json(self) -> bytes:
        return json.dumps(vars(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Lease | None:
        """The lease, or None for an object that is not one (damaged, or written by hand): treated as expired."""
        try:
            fields: dict[str, Any] = json.loads(data)
            return cls(str(fields["host"]), int(fields["pid"]), float(fields["since"]), float(fields["expires"]),
                       str(fields["token"]))  # fmt: skip
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self, now: float) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        left = self.expires - now
        return f"host {self.host}, pid {self.pid}, since {since} (its lease expires in {left:.0f} s unless renewed)"


class PrefixLease:
    """The write lease of one checkpoint folder on an object store. Local; the same face as
    :class:`~dist_resume._manager.lock.FolderLock` (``acquire``, ``release``, ``held``, ``path``)."""

    def __init__(self, folder: RemotePath) -> None:
        self.path = folder / LEASE_NAME
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
        return Lease(
            socket.gethostname(), os.getpid(), now if since is None else since, now + LEASE_SECONDS, self._token
        )

    def _read(self) -> tuple[Lease | None, bool]:
        """The lease there now (None for a damaged one) and whether an object is there at all."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None, False
        return Lease.from_json(data), True

    def acquire(self) -> None:
        """Take the lease, or raise :class:`CheckpointWriteError` naming the holder. A lease this manager lost (it
        stalled past the expiry and another job took it) raises too."""
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
        self._token = secrets.token_hex(16)
        try:
            self._take()
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

    def _take(self) -> None:
        for _ in range(3):  # a lease that expired (or vanished) meanwhile is taken on the next round
            try:
                if put_if_absent(self.path, self._new().to_json()):
                    return
                current, present = self._read()
            except OSError as err:
                raise CheckpointWriteError(
                    f"cannot take the write lease of checkpoint folder {str(self.path.parent)!r} ({self.path}): "
                    f"{type(err).__name__}: {err}; check the credentials and that the bucket exists"
                ) from err
            if not present:
                continue
            now = time.time()
            if current is not None and current.expires > now:
                raise CheckpointWriteError(
                    f"cannot save into checkpoint folder {str(self.path.parent)!r}: it is leased by "
                    f"{current.describe(now)}: another job is saving into this folder (a relaunch while the old "
                    "allocation still runs?). One writer per folder: stop the other writer or save into another "
                    f"folder; reading (resume, latest_checkpoint) needs no lease. The lease object is {str(self.path)!r}; "
                    f"a job that died leaves it to expire within {LEASE_SECONDS:.0f} s"
                )
            again, _ = self._read()  # expired (or not a lease): delete it only if it is still the same one
            if again == current:
                self.path.unlink(missing_ok=True)
                what = (
                    "damaged"
                    if current is None
                    else f"expired {now - current.expires:.0f} s ago ({current.host}, pid {current.pid})"
                )
                logger.info("took over the write lease of %s: the previous one %s", self.path.parent, what)
        raise CheckpointWriteError(
            f"cannot take the write lease of checkpoint folder {str(self.path.parent)!r}: another writer keeps "
            "replacing it; stop the other writer"
        )

    def _renew(self) -> None:
        since = time.time()
        while not self._stop.wait(RENEW_SECONDS):
            token = self._token
            if token is None:
                return
            try:
                current, _ = self._read()
                if current is None or current.token != token:
                    self._lost = f"its lease object was {'replaced by ' + current.host + ' pid ' + str(current.pid) if current else 'deleted'}"
                    logger.error("lost the write lease of %s: %s", self.path.parent, self._lost)
                    return
                self.path.fs.pipe_file(self.path.key, self._new(since).to_json())
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


def writer_lock(folder: Location) -> FolderLock | PrefixLease:
    """The one-writer guard of ``folder``: ``flock`` on a local folder, a lease on an object store. Local."""
    return PrefixLease(folder) if isinstance(folder, RemotePath) else FolderLock(folder)
