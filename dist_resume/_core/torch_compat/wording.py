"""What torch's error messages mean: the one place that reads their wording.

torch raises most load and collective failures as plain ``RuntimeError`` / ``UnpicklingError``
whose only distinguishing mark is the text. Each reader here says which torch versions' wording it
matches (checked on torch 2.13); when torch rewords one, this is the one module to fix. Its
private APIs live beside it, in :mod:`dist_resume._core.torch_compat.private`.
"""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from enum import Enum

import torch

__all__ = [
    "CommFailure",
    "GARBLED_PICKLE",
    "LoadFailure",
    "RefusedGlobal",
    "classify_comm_error",
    "classify_load_error",
    "comm_error_summary",
    "dcp_cause",
    "error_summary",
    "is_damaged_pickle_error",
    "is_garbled_pickle",
    "is_out_of_memory",
    "refused_global",
]


# torch._weights_only_unpickler raises UnpicklingError("Weights only load failed ...") for refused
# globals AND for bytes it cannot parse; these phrases (its own messages, torch >= 2.4) mean the
# latter: damaged bytes, not a refused object.
GARBLED_PICKLE = ("Unsupported operand", "String is too long", "Expected bytes, got")


def is_garbled_pickle(err: BaseException) -> bool:
    """The weights_only unpickler choked on damaged bytes (see :data:`GARBLED_PICKLE`)."""
    return any(marker in str(err) for marker in GARBLED_PICKLE)


class LoadFailure(Enum):
    """What an exception from ``torch.load`` means, read from its text."""

    UNSAFE = "unsafe"  # weights_only refused a global
    NO_DEVICE = "no_device"  # a storage is bound for a device this process lacks
    NOT_TORCH_ARCHIVE = "not_torch_archive"  # a zip, but not one torch.save wrote
    DAMAGED = "damaged"  # truncated or corrupt bytes
    OTHER = "other"


# torch.serialization's refusals of a storage's location tag (torch 2.6 - 2.13 wording): validate_cuda_device
# and _validate_device for cuda, xpu and PrivateUse1 tags ("Attempting to deserialize object on a CUDA device
# but torch.cuda.is_available() is False", "... on XPU device 5 but torch.xpu.device_count() is 2"), a tag of
# a backend torch does not have ("The HPU device module is not registered"), a tag no deserializer claims
# ("don't know how to restore data location of ... (tagged with sim:1)"), mps on a host without it, and a
# device index past the driver's ("CUDA error: invalid device ordinal")
_NO_DEVICE = (
    "Attempting to deserialize object on",
    "device module is not registered",
    "don't know how to restore data location",
    "Storage device not recognized",
    "invalid device ordinal",
)


def classify_load_error(err: BaseException) -> LoadFailure:
    """Classify an ``UnpicklingError`` or ``RuntimeError`` raised by ``torch.load`` (torch 2.6 - 2.13 wording)."""
    text = str(err)
    # torch.load(weights_only=True) wraps every unpickler error in "Weights only load failed" (torch >= 2.4)
    if "Weights only load failed" in text and not is_garbled_pickle(err):
        return LoadFailure.UNSAFE
    if any(marker in text for marker in _NO_DEVICE):
        return LoadFailure.NO_DEVICE
    # PyTorchStreamReader (caffe2/serialize/inline_container.cc) on a zip without torch's records
    if 'hasRecord("version")' in text or "failed locating file data.pkl" in text:
        return LoadFailure.NOT_TORCH_ARCHIVE
    # PyTorchStreamReader on a truncated zip ("failed finding central directory"), and the storage
    # size checks when a truncated file is memory-mapped or read ("... storage ... bytes ...")
    # ("inline_container.cc": the same reader's other checks, e.g. "Couldn't parse the version ZZ")
    if (
        "PytorchStreamReader" in text
        or "zip archive" in text
        or "inline_container.cc" in text
        or "storage" in text.lower()
    ):
        return LoadFailure.DAMAGED
    return LoadFailure.OTHER


def error_summary(err: BaseException) -> str:
    """``Type: first line`` of a torch error, preferring the unpickler's own detail line and dropping
    torch's "This is an internal error" boilerplate (wording of torch 2.6 - 2.13)."""
    lines = str(err).splitlines() or [""]
    detail = [line for line in lines if any(m in line for m in GARBLED_PICKLE)]
    text = (detail or lines)[0].split(". This is an internal")[0]
    return f"{type(err).__name__}: {text[:200]}"


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep


def _inside_torch_or_stdlib(filename: str) -> bool:
    path = os.path.abspath(filename)
    if path.startswith(_TORCH_DIR):
        return True
    return path.startswith(_STDLIB_DIR) and "-packages" not in path[len(_STDLIB_DIR) :]


def is_damaged_pickle_error(err: BaseException) -> bool:
    """A KeyError, IndexError, TypeError, AttributeError ... out of ``torch.load`` that a damaged data.pkl
    caused, rather than a bug in code torch called back (a ``map_location`` callable).

    torch.load does not wrap what its unpickler and tensor rebuilding raise on garbled bytes (checked on
    torch 2.13: ``_rebuild_tensor_v2() missing 1 required positional argument``, ``'tuple' object has no
    attribute 'dtype'``, ``KeyError: 130`` from the memo, ``list index out of range``, ``unhashable
    type``). Such an error counts as damage only when every frame below the caller's lies in torch
    (or the standard library's pickle machinery): a frame of any other code means that code failed.
    """
    frames = []
    tb = err.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    return len(frames) > 1 and all(_inside_torch_or_stdlib(f) for f in frames[1:])


def is_out_of_memory(err: BaseException) -> bool:
    """torch's allocators report exhaustion as RuntimeError ("DefaultCPUAllocator: can't allocate memory",
    "CUDA out of memory"; checked on torch 2.13): a real shortage, never a sign of a damaged file."""
    text = str(err).lower()
    return "out of memory" in text or "can't allocate memory" in text


@dataclass(frozen=True)
class RefusedGlobal:
    """The global a weights_only load refused, as torch's message names it."""

    name: str | None  # e.g. "argparse.Namespace"; a builtin comes without "builtins." ("exec")
    blocked_module: str | None = None  # set when torch blocks the whole module (os, subprocess, ...)

    @property
    def is_builtin(self) -> bool:
        return self.name is not None and "." not in self.name.strip(".")


def refused_global(err: BaseException) -> RefusedGlobal:
    """Parse torch._weights_only_unpickler's refusal: "GLOBAL x.y whose module x is blocked" (a module
    on its deny list, torch >= 2.4) or "GLOBAL x.y was not an allowed global" (torch >= 2.4)."""
    text = str(err)
    blocked = re.search(r"GLOBAL (\S+) whose module (\S+) is blocked", text)
    if blocked:
        return RefusedGlobal(blocked.group(1), blocked.group(2).rstrip("."))
    found = re.search(r"GLOBAL (\S+) was not an allowed global", text)
    return RefusedGlobal(found.group(1) if found else None)


class CommFailure(Enum):
    """Why a torch.distributed collective raised, read from its text."""

    PEER_GONE = "peer_gone"  # a peer process closed its connection: it died or exited
    TIMEOUT = "timeout"  # nothing arrived within the process-group timeout: a peer is stuck or absent
    OTHER = "other"


# gloo's tcp transport (third_party/gloo/gloo/transport/tcp/pair.cc) reports a peer that died as
# "Connection closed by peer [addr]" (EOF), "Read error ...: Connection reset by peer" (RST) or
# "Write error ...: Broken pipe"; torch 2.4 - 2.13 raise it as a plain RuntimeError.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
# gloo: "Timed out waiting <n>ms for send/recv operation to complete" (unbound_buffer.cc);
# c10d's store and DistStoreError: "Timeout" / "timed out"; nccl's watchdog aborts the process instead.
_TIMED_OUT = ("timed out", "timeout")


def classify_comm_error(err: BaseException) -> CommFailure:
    """Classify an exception raised by a torch.distributed collective (gloo wording, torch 2.4 - 2.13)."""
    text = str(err)
    if any(marker in text for marker in _PEER_GONE):
        return CommFailure.PEER_GONE
    if any(marker in text.lower() for marker in _TIMED_OUT):
        return CommFailure.TIMEOUT
    return CommFailure.OTHER


def comm_error_summary(err: BaseException) -> str:
    """``Type: first line`` of a collective's error without gloo's source location prefix
    ("[/path/pair.cc:553] ") and its advice suffix (". This is typically caused by ..."), torch 2.4 - 2.13."""
    line = (str(err).splitlines() or [""])[0]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", line)
    line = line.split(". This is typically")[0]
    return f"{type(err).__name__}: {line[:200]}"


def dcp_cause(err: BaseException) -> BaseException:
    """The exception a rank raised inside ``torch.distributed.checkpoint``'s ``CheckpointException`` (a
    ``BaseException``, so ``except Exception`` misses it; its ``failures`` map each failed rank to ``(exception,
    traceback)``), the first rank's, through wrappers of wrappers; ``err`` itself when it wraps nothing (torch 2.4 -
    2.13)."""
    for _ in range(8):  # a wrapper holds the rank's own exception, or another wrapper: a few levels at most
        failures = getattr(err, "failures", None)
        if not isinstance(failures, dict) or not failures:
            break
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if not isinstance(inner, BaseException):
            break
        err = inner
    return err
