"""The exception hierarchy. Every error the toolkit raises on purpose derives from DistResumeError."""

from __future__ import annotations

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
    "UsageError",
]


class DistResumeError(Exception):
    """Base class of every error raised by dist_resume."""


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


class UsageError(DistResumeError, ValueError):
    """An operation cannot run as asked (SRC == DST, DST exists, ...); ``hint`` says what to do instead."""

    def __init__(self, message: str, hint: str = "") -> None:
        super().__init__(message)
        self.hint = hint
