"""The exception hierarchy: every error the toolkit raises on purpose derives from DistResumeError.

The tree is drawn once, in the docstring of the public :mod:`dist_resume.errors`, which re-exports these
classes. Every one pickles with its attributes (and ``rank``), so a failure on one rank can be raised on the
others as the same class: see :mod:`dist_resume._dist.comm`.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DistResumeError",
    "EnvironmentMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "CheckpointWriteError",
    "CheckpointConsensusError",
    "KeyMismatchError",
    "OptimizerStateMismatchError",
    "StateMismatchError",
    "DeviceMismatchError",
    "RestoreError",
    "PartialRestoreError",
    "UsageError",
    "CheckCommandError",
    "SimBuildError",
    "rebuild_error",
]


class DistResumeError(Exception):
    """Base class of every error raised by dist_resume.

    ``rank`` is the global rank the failure happened on when another rank relayed it to this one
    (None for an error raised where it happened).
    """

    rank: int | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # BaseException's own reduction calls ``cls(*args)``: it breaks as soon as a subclass takes a
        # required keyword. Rebuild without __init__: the args, then every attribute (rank included).
        return (_rebuild, (type(self), self.args), dict(self.__dict__))


def _rebuild(cls: type[DistResumeError], args: tuple[Any, ...]) -> DistResumeError:
    """Unpickling half of :meth:`DistResumeError.__reduce__` (pickle then restores ``__dict__``)."""
    err = cls.__new__(cls, *args)
    err.args = args
    return err


def rebuild_error(cls: type[DistResumeError], message: str, attributes: dict[str, Any]) -> DistResumeError:
    """``cls`` with ``message`` and ``attributes`` set, without calling its ``__init__`` (for relayed errors)."""
    err = _rebuild(cls, (message,))
    err.__dict__.update(attributes)
    return err


class EnvironmentMismatchError(DistResumeError, ValueError):
    """The torchrun / torch.distributed environment is inconsistent (bad RANK, LOCAL_RANK, ...)."""


class CheckpointError(DistResumeError):
    """A checkpoint file could not be read or written."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint path does not exist, or is not a file."""


class CheckpointCorruptError(CheckpointError):
    """The file is empty, truncated or damaged (typically a save that was interrupted)."""


class NotACheckpointError(CheckpointError):
    """The file exists but is not a file written by ``torch.save`` (or is an unsupported variant)."""


class UnsafeCheckpointError(CheckpointError):
    """Loading the file would need ``weights_only=False``: it references globals torch refuses by default."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed (disk full, permissions, ...). The previous checkpoint is untouched."""


class CheckpointConsensusError(CheckpointError):
    """Ranks did not agree on which checkpoint to resume from.

    ``ranks`` lists the ranks whose view differs from rank 0's choice (empty when the agreement
    itself failed: a rank died or never joined within the process-group timeout).
    """

    def __init__(self, message: str, *, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        self.ranks = ranks or []


class StateMismatchError(DistResumeError, ValueError):
    """A checkpoint's contents do not fit the objects they are restored into."""


class KeyMismatchError(StateMismatchError):
    """Model state keys, shapes or dtypes do not fit the model.

    ``missing``, ``unexpected`` and ``mismatched`` hold the full lists; the message shows the first few.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        mismatched: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.missing = missing or []
        self.unexpected = unexpected or []
        self.mismatched = mismatched or []


class OptimizerStateMismatchError(StateMismatchError):
    """Saved optimizer state does not fit the optimizer (class, groups, names or state shapes)."""


class DeviceMismatchError(DistResumeError, RuntimeError):
    """Tensors that must share a device do not (optimizer state vs. its parameter, batch vs. model)."""

    def __init__(self, message: str, *, findings: list[str] | None = None) -> None:
        super().__init__(message)
        self.findings = findings or []


class RestoreError(DistResumeError, RuntimeError):
    """Applying a validated checkpoint failed part-way (``part`` names the step: ``"optimizer"``, ``"model"``, ...).

    Everything the resume had changed was put back before it was raised (on every rank, when the resume was
    collective); the original exception is chained as ``__cause__`` on the rank it happened on.
    """

    def __init__(self, message: str, *, part: str = "") -> None:
        super().__init__(message)
        self.part = part


class PartialRestoreError(RestoreError):
    """Writing the checkpoint's data into the live tensors failed after every rank had agreed to restore it.

    Everything that could fail was checked and run first, so this takes a fault in the last, in-place step (an I/O
    error reading the file's pages, a device error while copying, a peer lost mid-transfer): the model, EMA or
    optimizer ``part`` may hold part of the checkpoint. Resuming from the same checkpoint again restores it whole.
    Raised on every rank when the resume was collective, with ``rank`` naming the rank it happened on.
    """


class UsageError(DistResumeError, ValueError):
    """An operation cannot run as asked (SRC == DST, DST exists, ...); ``hint`` says what to do instead."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint


class CheckCommandError(DistResumeError, RuntimeError):
    """A command under ``dist-resume check`` could not be checked: it could not be started, failed on its own, wrote
    no checkpoint (or one only, or none after a resume: nothing to compare), or outlived the timeout. ``run`` names the run (``"reference"``, ``"relaunch 2"``), ``returncode`` is its exit
    status (None when it was stopped at the timeout) and ``stderr`` holds its last lines."""

    def __init__(self, message: str, *, run: str = "", returncode: int | None = None, stderr: str = "") -> None:
        super().__init__(message)
        self.run = run
        self.returncode = returncode
        self.stderr = stderr


class SimBuildError(DistResumeError, RuntimeError):
    """Compiling the test accelerator (``dist_resume.testing.sim``) failed; the message carries the compiler's
    output."""
