"""The boundary where a checkpoint's untrusted structure is read: its only way out is the typed error.

Everything read from a checkpoint that is not tensor data (the unpickled object's layout and parts, the manifest, DCP
``.metadata``, HF/Accelerate side files, a safetensors header) is checked by code written for the values a writer
produces. A damaged or edited file holds values that code never imagined: a tensor where a number was (``bool()``
raises), keys of mixed types (``sorted`` raises), an integer too large for a float, a ``__repr__`` that raises. Each
check is written to be total, and :func:`untrusted` makes the guarantee hold by construction: the reading and the
checking of one field run inside it, a :class:`~dist_resume.errors.DistResumeError` passes through as it is (and so do
``OSError`` and ``MemoryError``: the machine's trouble, not the file's, which the readers name themselves), and any
other exception (the check itself failing on a value it did not foresee) becomes
:class:`~dist_resume.errors.CheckpointCorruptError` naming the file and the field, chained to the original.

The readers enter it at each place untrusted structure comes in (docs/architecture.md lists them); code above a
reader gets values that passed their checks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .errors import CheckpointCorruptError, DistResumeError

__all__ = ["untrusted"]

_SHOWN = 160  # characters of the unforeseen error's text in the message


def _text(err: BaseException) -> str:
    """``TypeName: message`` of an exception raised on a damaged value, even when its ``str`` raises too."""
    try:
        said = str(err)
    except Exception:  # the message formats the damaged value (a KeyError's key whose __repr__ raises)
        said = ""
    if len(said) > _SHOWN:
        said = said[: _SHOWN - 3] + "..."
    return f"{type(err).__name__}: {said}" if said else type(err).__name__


@contextmanager
def untrusted(source: str, field: str) -> Iterator[None]:
    """Read and check ``field`` of ``source`` (``"checkpoint 'ckpt.pt'"``, ``"its optimizer state"``) inside the
    boundary: whatever the check did not foresee leaves as :class:`CheckpointCorruptError`. Local.

    Example::

        >>> with untrusted("checkpoint 'ckpt.pt'", "its scheduler state"):
        ...     sorted([1, "a"])
        Traceback (most recent call last):
        ...
        dist_resume.errors.CheckpointCorruptError: checkpoint 'ckpt.pt': its scheduler state could not be checked \
(TypeError: '<' not supported between instances of 'str' and 'int'): the file is damaged or was edited; resume from \
another checkpoint
    """
    try:
        yield
    except (DistResumeError, OSError, MemoryError):  # typed already; or the machine's trouble, not the file's
        raise
    except RecursionError as err:
        raise CheckpointCorruptError(
            f"{source}: {field} is nested too deeply to be checked: the file is damaged or was edited; resume from "
            "another checkpoint"
        ) from err
    except Exception as err:
        raise CheckpointCorruptError(
            f"{source}: {field} could not be checked ({_text(err)}): the file is damaged or was edited; resume from "
            "another checkpoint"
        ) from err
