"""The torch security floor: warn once if the installed torch has known ``weights_only`` bypasses.

"Never runs code from a file" rests on ``torch.load(weights_only=True)``, whose unpickler had
published flaws:

- CVE-2025-32434 (GHSA-53q9-r3pm-6pq6): ``torch.load(weights_only=True)`` could still execute
  code; torch <= 2.5.1 affected, fixed in 2.6.0.
- CVE-2026-24747: the ``weights_only`` unpickler did not validate ``SETITEM``/``SETITEMS`` targets
  and storage sizes, so a crafted file could corrupt memory (and possibly run code); torch < 2.10.0
  affected, fixed in 2.10.0.

The package requires ``torch>=2.10``; someone who installed it with ``--no-deps`` next to an older
torch gets one warning per process, at the first load.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from typing import Final

import torch

from .log import log_rank0

__all__ = ["SAFE_TORCH", "ADVISORIES", "TorchSecurityWarning", "torch_release", "warn_if_unsafe_torch"]

SAFE_TORCH: Final = (2, 10, 0)
"""The oldest torch release with both fixes below."""

ADVISORIES: Final = (
    ("CVE-2025-32434", "torch.load(weights_only=True) can execute code", (2, 6, 0)),
    ("CVE-2026-24747", "memory corruption in the weights_only unpickler", (2, 10, 0)),
)
"""(CVE, what it allows, first fixed release) for every known flaw of the ``weights_only`` unpickler."""


class TorchSecurityWarning(UserWarning):
    """The installed torch is older than the release that fixed a ``weights_only`` bypass."""


_warned = False
_warned_lock = threading.Lock()


def torch_release(version: str) -> tuple[int, int, int] | None:
    """``(major, minor, patch)`` of a torch version string (``'2.9.1+cu126'``, ``'2.10.0a0+git1234'``).

    Pre-releases and local builds count as their release (an ``a0`` build of 2.10.0 as 2.10.0).
    None if the string does not start with a version number.
    """
    found = re.match(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def _fmt(release: tuple[int, int, int]) -> str:
    return ".".join(map(str, release))


def warn_if_unsafe_torch() -> bool:
    """Warn once per process (``TorchSecurityWarning`` + a log record) if torch predates a fix; True if it does.

    Local, cheap after the first call. Call it before reading any file with ``torch.load`` or the
    archive reader.
    """
    global _warned
    if _warned:
        return False
    with _warned_lock:
        if _warned:
            return False
        _warned = True
    version = str(torch.__version__)
    release = torch_release(version)
    if release is None or release >= SAFE_TORCH:
        return False
    open_ = [f"{cve} ({what}, fixed in {_fmt(fixed)})" for cve, what, fixed in ADVISORIES if release < fixed]
    message = (
        f"torch {version} is older than {_fmt(SAFE_TORCH)}, so torch.load(weights_only=True) has published "
        f"flaws: {'; '.join(open_)}. dist_resume loads with weights_only=True, but on this torch a crafted "
        f"checkpoint file may still run code: upgrade torch (pip install 'torch>={_fmt(SAFE_TORCH)}') and "
        "load only files you trust until then"
    )
    warnings.warn(message, TorchSecurityWarning, stacklevel=3)
    log_rank0(logging.WARNING, "%s", message)
    return True
