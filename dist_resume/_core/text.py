"""Wording shared by every message: one preview of a long list, one indefinite article, one way to show a value
read from a file."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

__all__ = ["preview", "article", "shown", "described"]


def preview(items: Iterable[Any], n: int = 5, *, sep: str = ", ", quote: bool = True, count: bool = False) -> str:
    """The first ``n`` items and how many more: ``'a', 'b' and 3 more``.

    ``quote`` shows each item with ``repr`` (keys, paths) instead of ``str`` (sentences); ``count``
    puts the total first (``5: 'a', 'b' and 3 more``).

    Example::

        >>> preview(["a", "b", "c"], 2)
        "'a', 'b' and 1 more"
    """
    seq = list(items)
    shown = sep.join(described(x, _WHOLE) if quote else str(x) for x in seq[:n])
    more = f" and {len(seq) - n} more" if len(seq) > n else ""
    return f"{len(seq)}: {shown}{more}" if count else f"{shown}{more}"


def article(word: str) -> str:
    """``word`` with its indefinite article: ``an AdamW``, ``an SGD``, ``a GradScaler``, ``an optimizer``.

    Example::

        >>> article("AdamW")
        'an AdamW'
    """
    head = word.split()[0] if word.split() else word
    acronym = len(head) > 1 and head[:2].isupper()  # spelled out: "an SGD", "an LBFGS", "a GradScaler"
    vowel_sound = head[:1].upper() in "AEFHILMNORSX" if acronym else head[:1].lower() in "aeio"
    return f"{'an' if vowel_sound else 'a'} {word}"


def shown(value: Any) -> str:
    """A hyperparameter as a person reads it: ``0.0003``, not ``0.00030000000000000003`` (6 significant digits).

    Example::

        >>> shown(1.0000000000000002e-06), shown((0.9, 0.999)), shown("cpu")
        ('1e-06', '(0.9, 0.999)', "'cpu'")
    """
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, tuple) and value and all(isinstance(v, float) for v in value):
        return "(" + ", ".join(f"{v:.6g}" for v in value) + ")"
    return described(value, _WHOLE)


def described(value: Any, n: int = 100) -> str:
    """``repr(value)`` cut to ``n`` characters, for a value unpickled from a damaged file: its ``__repr__`` may itself
    raise (a dataclass whose fields the file left out; an int past Python's 4,300 digits), and then the type is named
    instead (an int by its size).

    Example::

        >>> Info = type("Info", (), {"__repr__": lambda self: self.gone})
        >>> described("x" * 200)[-5:], described(Info()), described(10**5000)
        ('xx...', 'an Info that cannot be shown', 'an int of 16610 bits')
    """
    try:
        text = repr(value)
    except Exception:  # whatever the damaged object's __repr__ raises
        if isinstance(value, int):  # sys.get_int_max_str_digits(): a number read from a file may be longer
            return f"{'a negative' if value < 0 else 'an'} int of {value.bit_length()} bits"
        return f"{article(type(value).__name__)} that cannot be shown"
    return text if len(text) <= n else text[: n - 3] + "..."


_WHOLE: Final = 1 << 20  # what preview and shown show uncut (a key, a path): what repr gives, when it gives one
