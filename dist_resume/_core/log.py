"""The library logger, what it prints when the application set up no logging, and a rank-0 logging helper.

What a user must see (one line per resume and per save, on global rank 0) is INFO on ``logging.getLogger(
"dist_resume")``. Python's default prints only WARNING and above, and only through its last-resort handler, so the
library does what Lightning and transformers do: the ``"dist_resume"`` logger gets one handler of its own, which
writes to stderr only while no other handler would receive the record (the application configured no logging:
``logging.basicConfig()``, a handler on the root logger or on ``"dist_resume"``). Once the application configures
logging, even after the first line, the records reach its handlers alone, once each. The root logger is never
touched. The logger's level is INFO unless :data:`VERBOSITY_ENV` or :func:`set_verbosity` says otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Final

from .errors import EnvironmentMismatchError, UsageError
from .location import Location, RemotePath
from .rank import global_rank

__all__ = ["logger", "log_rank0", "log_saved", "set_verbosity", "VERBOSITY_ENV", "shown_path", "file_size"]

VERBOSITY_ENV: Final = "DIST_RESUME_VERBOSITY"
"""The environment variable that sets the ``"dist_resume"`` logger's level when the library is imported:
``debug``, ``info`` (the default), ``warning`` or ``error``."""

_LEVELS: Final = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}

logger = logging.getLogger("dist_resume")


class _UnconfiguredHandler(logging.Handler):
    """Writes a record's message to the current ``sys.stderr`` while no other handler would receive it.

    Python calls :data:`logging.lastResort` only when it finds no handler at all, and this one counts as one: so
    it prints warnings too, as the last resort did, in the same form (the message alone). It looks up
    ``sys.stderr`` at each record (as the last resort does), so a redirected stderr gets the lines.
    """

    def emit(self, record: logging.LogRecord) -> None:  # the message alone, as the last resort prints it
        if _configured_elsewhere(self):
            return
        stream = sys.stderr
        if stream is None:  # pythonw: nowhere to write
            return
        try:
            stream.write(self.format(record) + "\n")
            stream.flush()
        except RecursionError:  # as logging.StreamHandler does
            raise
        except Exception:
            self.handleError(record)


def _configured_elsewhere(own: logging.Handler) -> bool:
    """Whether a handler other than ``own`` is on ``"dist_resume"`` or, while it propagates, an ancestor (root)."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(handler is not own for handler in current.handlers):
            return True
        if not current.propagate:
            return False
        current = current.parent
    return False


def _install() -> None:
    """The handler, once (a reloaded module finds the one installed before), and the level from the environment."""
    if not any(isinstance(h, _UnconfiguredHandler) for h in logger.handlers):
        logger.addHandler(_UnconfiguredHandler())
    raw = os.environ.get(VERBOSITY_ENV, "").strip().lower()
    logger.setLevel(_LEVELS.get(raw, logging.INFO))
    if raw and raw not in _LEVELS:  # logging never raises: say it, keep the default
        logger.warning("%s=%r is not one of %s: using info", VERBOSITY_ENV, raw, ", ".join(_LEVELS))


def set_verbosity(level: int | str) -> None:
    """Set what dist_resume logs: ``"debug"``, ``"info"`` (the default), ``"warning"`` or ``"error"`` (or a
    ``logging`` level such as ``logging.WARNING``).

    Local: it sets the level of this process's ``logging.getLogger("dist_resume")`` (call it on every rank where it
    matters; only global rank 0 logs the resume and save lines). ``"info"`` shows one line per resume and one per
    save; ``"warning"`` hides them and keeps what you should know about; ``"error"`` hides warnings too;
    ``"debug"`` adds the details. With no logging set up the lines go to stderr; once the application configures
    logging (``logging.basicConfig()``, a handler of its own) they reach its handlers instead, once each. The
    environment variable ``DIST_RESUME_VERBOSITY`` sets the same level when dist_resume is imported; this call
    overrides it. Raises :class:`~dist_resume.errors.UsageError` for another name.

    Example::

        >>> import logging
        >>> dist_resume.set_verbosity("warning")  # quiet: no resume/save lines, warnings still shown
        >>> logging.getLogger("dist_resume").level == logging.WARNING
        True
        >>> dist_resume.set_verbosity(logging.INFO)  # back to the default
    """
    if isinstance(level, str) and level.strip().lower() in _LEVELS:
        logger.setLevel(_LEVELS[level.strip().lower()])
        return
    if isinstance(level, int) and not isinstance(level, bool) and level in _LEVELS.values():
        logger.setLevel(level)
        return
    raise UsageError(
        f"set_verbosity({level!r}): the level is one of {', '.join(map(repr, _LEVELS))}, or the logging constant",
        hint='call dist_resume.set_verbosity("warning") to quiet the resume and save lines',
    )


def _on_rank0() -> bool:
    """Whether this process is global rank 0; with a ``RANK`` that is not an integer it logs as rank 0 (logging never
    raises; ``rank_info`` reports the bad value)."""
    try:
        return global_rank() == 0
    except EnvironmentMismatchError:
        return True


def log_rank0(level: int, msg: str, *args: object) -> None:
    """Log on global rank 0 only; ``stacklevel`` points the record at the caller.

    The rank comes from :func:`dist_resume._core.rank.global_rank`, so it works before a process group exists.
    Logging never raises: with a ``RANK`` that is not an integer this process logs as rank 0 (``rank_info``
    reports the bad value).
    """
    if _on_rank0():
        logger.log(level, msg, *args, stacklevel=2)


def log_saved(
    path: Location, *, step: int | None, epoch: int | None, size: int | None, seconds: float, how: str = ""
) -> None:
    """The one line of a save, at INFO on global rank 0: ``saved /abs/run/ckpt_00000080.pt (step 80, epoch 4,
    12.3 MiB) in 0.20 s`` (``how``, e.g. ``", in the background"``, follows the time)."""
    if not _on_rank0():
        return
    facts = [f"step {step}"] if step is not None else []
    facts += [f"epoch {epoch}"] if epoch is not None else []
    facts.append(shown_size(size))
    logger.info("saved %s (%s) in %.2f s%s", shown_path(path), ", ".join(facts), seconds, how, stacklevel=2)


def shown_path(path: Location) -> str:
    """``path`` as a log line names it: a local path absolute (normalised, symlinks kept), a URL as it is."""
    if isinstance(path, RemotePath):
        return str(path)
    return os.path.abspath(path)


def shown_size(n: int | None) -> str:
    """``12.3 MiB``, ``512 B``; ``size unknown`` for None."""
    if n is None:
        return "size unknown"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def file_size(path: Location) -> int | None:
    """The size of the file at ``path`` (one ``stat``; a request on a store), None when it cannot be had: a log line
    never fails the save it reports."""
    try:
        return int(path.stat().st_size)
    except Exception:
        return None


_install()
