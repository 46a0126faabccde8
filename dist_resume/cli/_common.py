"""Shared pieces of the ``dist-resume`` command: exit codes, usage errors, JSON output, the progress bar."""

from __future__ import annotations

import enum
import json
import sys
import time
from typing import TYPE_CHECKING, Any, Final, TextIO

from .._core.errors import (
    CheckpointCorruptError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DistResumeError,
    EnvironmentMismatchError,
    KeyMismatchError,
    NotACheckpointError,
    UnsafeCheckpointError,
    UsageError,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "report_error",
    "ExitCode",
    "UsageError",
    "SCHEMA_PREFIX",
    "print_json",
    "human_bytes",
    "dtype_name",
    "ProgressBar",
    "jsonable",
]

SCHEMA_PREFIX: Final = "dist-resume"


class ExitCode(enum.IntEnum):
    """What the ``dist-resume`` exit status means (also listed by ``dist-resume --help``)."""

    OK = 0
    DIFFERENT = 1  # verify: the checkpoints differ
    INPUT = 2  # bad arguments, or an input that cannot be used (missing, damaged, unsafe, not a checkpoint, ...)
    WRITE = 3  # the output could not be written (permissions, disk full, missing folder)
    INTERNAL = 4  # a bug in dist-resume: please report it with the traceback
    INTERRUPTED = 130  # Ctrl-C


def jsonable(value: Any) -> Any:
    """``value`` with torch objects and other non-JSON values replaced by strings."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [jsonable(v) for v in value]
    loaded = sys.modules.get("torch")  # a torch dtype exists only where torch was imported (`list` may run without)
    if loaded is not None and isinstance(value, loaded.dtype):
        return dtype_name(value)
    return str(value)


def print_json(obj: dict[str, Any], *, compact: bool = False, stream: TextIO | None = None) -> None:
    out = stream or sys.stdout
    out.write(json.dumps(jsonable(obj), indent=None if compact else 2) + "\n")
    out.flush()


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class ProgressBar:
    """A one-line progress bar on a terminal; silent when disabled, or for work that ends within ``delay``."""

    def __init__(self, label: str, *, enabled: bool, stream: TextIO | None = None, delay: float = 0.5) -> None:
        self._label = label
        self._stream = stream or sys.stderr
        self._enabled = enabled
        self._start = time.monotonic()
        self._delay = delay
        self._last = 0.0
        self._shown = False

    @classmethod
    def for_stderr(cls, label: str, *, quiet: bool) -> ProgressBar:
        """Enabled only when stderr is a terminal and ``--quiet`` was not given."""
        return cls(label, enabled=not quiet and sys.stderr.isatty())

    def __call__(self, done: int, total: int) -> None:
        if not self._enabled:
            return
        now = time.monotonic()
        if now - self._start < self._delay or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        frac = done / total if total else 1.0
        width = 30
        filled = int(frac * width)
        rate = done / max(now - self._start, 1e-9)
        self._stream.write(
            f"\r{self._label} [{'#' * filled}{' ' * (width - filled)}] {frac:4.0%} "
            f"{human_bytes(done)} / {human_bytes(total)}  {human_bytes(int(rate))}/s "
        )
        self._stream.flush()
        self._shown = True

    def close(self) -> None:
        if self._shown:
            self._stream.write("\n")
            self._stream.flush()
            self._shown = False


_HINTS: tuple[tuple[type[BaseException], str], ...] = (
    (CheckpointNotFoundError, "check the path"),
    (CheckpointCorruptError, "the file is incomplete or damaged: use an earlier checkpoint"),
    (UnsafeCheckpointError, "dist-resume only reads what torch.load(weights_only=True) accepts"),
    (
        NotACheckpointError,
        "dist-resume reads torch.save files (zip format), HF Trainer, Accelerate and DCP folders and .safetensors "
        "files; --part PART=KEY names the key of a part it cannot tell",
    ),
    (CheckpointWriteError, "check free space and permissions in the destination folder"),
    (KeyMismatchError, "inspect the file with `dist-resume inspect` to see its keys"),
    (EnvironmentMismatchError, "these variables are set by torchrun: unset them, or launch with torchrun"),
    (DistResumeError, "run `dist-resume inspect` on the file for details"),
)


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in text.splitlines() if part.strip())


def report_error(command: str, err: BaseException) -> None:
    """One line on stderr: what failed, then a hint (a UsageError's own, else the one for its class)."""
    hint = err.hint if isinstance(err, UsageError) else next(h for cls, h in _HINTS if isinstance(err, cls))
    sys.stderr.write(f"dist-resume {command}: error: {_one_line(str(err))}\nhint: {hint}\n")
    sys.stderr.flush()
