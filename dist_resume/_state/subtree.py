"""One sub-tree of a state dict: the keys under ``key_prefix`` (a LightningModule's ``model.``), and finding it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import TypeVar

from torch import nn

from .._core.errors import KeyMismatchError, UsageError
from .._core.text import preview
from .prefix import match_keys, model_key_map

__all__ = ["check_key_prefix", "select_prefix", "suggest_key_prefix"]

V = TypeVar("V")


def check_key_prefix(key_prefix: object) -> str:
    """``key_prefix`` when it is a dot-separated key prefix ending in ``.`` (``"model."``); else :class:`UsageError`."""
    if not isinstance(key_prefix, str) or not key_prefix.endswith(".") or key_prefix.startswith("."):
        raise UsageError(
            f"key_prefix must be a dot-separated key prefix ending in '.', got {key_prefix!r}",
            hint="e.g. key_prefix='model.' for a Lightning checkpoint of self.model",
        )
    return key_prefix


def select_prefix(state_dict: Mapping[str, V], key_prefix: str, source: str = "checkpoint") -> OrderedDict[str, V]:
    """The entries whose key starts with ``key_prefix``, with it removed; every other key is left out.

    Local; no tensor is copied; ``_metadata`` follows (``model.fc`` becomes ``fc``, ``model`` the root).
    Raises :class:`KeyMismatchError` naming the leading key components present when no key starts
    with ``key_prefix``.

    Example::

        >>> sd = {"model.fc.weight": torch.zeros(1), "loss.weight": torch.zeros(1)}
        >>> list(select_prefix(sd, "model."))
        ['fc.weight']
    """
    check_key_prefix(key_prefix)
    out: OrderedDict[str, V] = OrderedDict(
        (k[len(key_prefix) :], v) for k, v in state_dict.items() if k.startswith(key_prefix)
    )
    if not out:
        heads = sorted({k.split(".", 1)[0] + "." for k in state_dict if "." in k})
        raise KeyMismatchError(
            f"{source}: no model key starts with key_prefix={key_prefix!r}; the keys start with "
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


def suggest_key_prefix(saved_keys: Iterable[str], unexpected: Iterable[str], model: nn.Module) -> str | None:
    """The ``key_prefix=`` that would make ``model`` fit, or None: every unexpected key shares leading
    components (other than wrapper prefixes) whose removal pairs every model key. Local; words
    :class:`KeyMismatchError`'s hint."""
    split = [k.split(".")[:-1] for k in unexpected]  # module path components, never the entry's own name
    if not split:
        return None
    common: list[str] = []
    for column in zip(*split):
        if len(set(column)) != 1:
            break
        common.append(column[0])
    targets = model_key_map(model)
    saved = list(saved_keys)
    for depth in range(1, len(common) + 1):
        if common[depth - 1] in ("module", "_orig_mod"):  # wrapper prefixes are adapted anyway
            continue
        prefix = ".".join(common[:depth]) + "."
        under = [k[len(prefix) :] for k in saved if k.startswith(prefix)]
        if under and set(match_keys(under, targets).values()) == set(targets.values()):
            return prefix
    return None
