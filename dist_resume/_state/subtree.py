"""One sub-tree of a state dict: the keys under ``key_prefix`` (a LightningModule's ``model.``), and finding it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TypeVar

from .._core.errors import KeyMismatchError
from .._core.text import preview
from .prefix import canonical_key

__all__ = ["select_prefix", "suggest_key_prefix"]

V = TypeVar("V")


def select_prefix(state_dict: Mapping[str, V], key_prefix: str) -> OrderedDict[str, V]:
    """The entries whose key starts with ``key_prefix``, with it removed; every other key is left out.

    Local; no tensor is copied; ``_metadata`` follows (``model.fc`` becomes ``fc``, ``model`` the root).
    Raises :class:`KeyMismatchError` naming the leading key components present when no key starts
    with ``key_prefix``.

    Example::

        >>> sd = {"model.fc.weight": torch.zeros(1), "loss.weight": torch.zeros(1)}
        >>> list(select_prefix(sd, "model."))
        ['fc.weight']
    """
    if not key_prefix or not key_prefix.endswith("."):
        raise ValueError(f"key_prefix must be a non-empty key prefix ending in '.', got {key_prefix!r}")
    out: OrderedDict[str, V] = OrderedDict(
        (k[len(key_prefix) :], v) for k, v in state_dict.items() if k.startswith(key_prefix)
    )
    if not out:
        heads = sorted({k.split(".", 1)[0] + "." for k in state_dict if "." in k})
        raise KeyMismatchError(
            f"no key of the checkpoint's model state starts with key_prefix={key_prefix!r}; the keys start with "
            f"{preview(heads) or 'no common prefix'}; pass one of those, or no key_prefix",
            unexpected=list(state_dict)[:50],
        )
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        bare = key_prefix[:-1]
        sub = OrderedDict(
            ("" if name == bare else name[len(key_prefix) :], value)
            for name, value in meta.items()
            if name == bare or name.startswith(key_prefix)
        )
        out._metadata = sub  # type: ignore[attr-defined]
    return out


def suggest_key_prefix(saved_keys: Iterable[str], model_keys: Iterable[str]) -> str | None:
    """The ``key_prefix`` whose removal makes ``saved_keys`` fit ``model_keys``, when exactly one does.

    Every saved key must share the same leading component (``model.``); after removing it the canonical
    keys must cover every model key. Local; used to word :class:`KeyMismatchError`'s hint.
    """
    saved = list(saved_keys)
    heads = {k.split(".", 1)[0] for k in saved if "." in k}
    want = {canonical_key(k) for k in model_keys}
    for head in sorted(heads):
        prefix = f"{head}."
        under = {canonical_key(k[len(prefix) :]) for k in saved if k.startswith(prefix)}
        if want and want <= under:
            return prefix
    return None
