"""Every exception and warning dist_resume raises on purpose, under one base class, :class:`DistResumeError`.

::

    DistResumeError                      .rank: where it happened, when another rank relayed it
    ├── EnvironmentMismatchError         (also ValueError)
    ├── CheckpointError
    │   ├── CheckpointNotFoundError      (also FileNotFoundError)
    │   ├── CheckpointCorruptError
    │   ├── NotACheckpointError
    │   ├── UnsafeCheckpointError
    │   ├── CheckpointWriteError
    │   └── CheckpointConsensusError     .ranks
    ├── StateMismatchError               (also ValueError)
    │   ├── KeyMismatchError             .missing .unexpected .mismatched
    │   └── OptimizerStateMismatchError
    ├── DeviceMismatchError              .findings (also RuntimeError)
    ├── RestoreError                     .part (also RuntimeError)
    │   └── PartialRestoreError          the last, in-place step failed: resume again
    ├── UsageError                       .hint (also ValueError)
    ├── CheckCommandError                .run .returncode .stderr (also RuntimeError): dist-resume check
    └── SimBuildError                    (also RuntimeError): the test accelerator did not build

    TorchSecurityWarning                 (a UserWarning: the installed torch predates a security fix)

``DistResumeError`` is importable from ``dist_resume`` too (``except dist_resume.DistResumeError``). Every
error pickles with its attributes, so a failure on one rank is raised on the others as the same class.

Example::

    >>> from dist_resume.errors import CheckpointNotFoundError, DistResumeError
    >>> issubclass(CheckpointNotFoundError, (DistResumeError, FileNotFoundError))
    True
"""

from __future__ import annotations

from ._core.errors import (
    CheckCommandError,
    CheckpointConsensusError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DeviceMismatchError,
    DistResumeError,
    EnvironmentMismatchError,
    KeyMismatchError,
    NotACheckpointError,
    OptimizerStateMismatchError,
    PartialRestoreError,
    RestoreError,
    SimBuildError,
    StateMismatchError,
    UnsafeCheckpointError,
    UsageError,
)
from ._core.publish import publish
from ._core.security import TorchSecurityWarning

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
    "StateMismatchError",
    "KeyMismatchError",
    "OptimizerStateMismatchError",
    "DeviceMismatchError",
    "RestoreError",
    "PartialRestoreError",
    "UsageError",
    "CheckCommandError",
    "SimBuildError",
    "TorchSecurityWarning",
]

publish(globals(), __all__, __name__)

del publish
