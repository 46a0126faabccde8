"""Key forms: ``module.`` (DDP, DataParallel), ``_orig_mod.`` (torch.compile), and re-keying between them."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

from .._core.errors import KeyMismatchError
from .._core.torch_compat.private import compiled_original

__all__ = [
    "DDP_PREFIX",
    "COMPILE_PREFIX",
    "without_compile",
    "strip_prefix",
    "add_prefix",
    "unwrap_model",
    "wrapper_prefix",
    "canonical_key",
    "canonical_state_dict",
    "model_key_map",
    "match_keys",
    "prefix_style",
]

DDP_PREFIX = "module."
COMPILE_PREFIX = "_orig_mod."
_WRAPPER_PARTS = ("module", "_orig_mod")

V = TypeVar("V")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix.endswith(".") or prefix.startswith(".") or ".." in prefix:
        raise ValueError(f"prefix must look like 'module.' (dot-separated, ending in one dot), got {prefix!r}")


def _rekey_metadata(src: Mapping[str, Any], dst: dict[str, Any], rename: dict[str, str]) -> None:
    metadata = getattr(src, "_metadata", None)
    if metadata is None:
        return
    new_meta: OrderedDict[str, Any] = OrderedDict()
    for name, value in metadata.items():
        if name in rename:
            new_meta[rename[name]] = value
    dst._metadata = new_meta  # type: ignore[attr-defined]


def strip_prefix(state_dict: Mapping[str, V], prefix: str = DDP_PREFIX) -> OrderedDict[str, V]:
    """Return a new state dict whose keys lose a *leading* ``prefix``.

    Local; no tensor is copied. Keys without the prefix are kept as they are; ``submodule.weight``
    never becomes ``subweight``. ``state_dict._metadata`` is re-keyed the same way, so module
    versions (BatchNorm, ...) survive.

    Example::

        >>> sd = {"module.fc.weight": torch.zeros(2, 2), "module.submodule.bias": torch.zeros(2)}
        >>> list(dist_resume.strip_prefix(sd))
        ['fc.weight', 'submodule.bias']
    """
    _check_prefix(prefix)
    out: OrderedDict[str, V] = OrderedDict(
        (k[len(prefix) :] if k.startswith(prefix) else k, v) for k, v in state_dict.items()
    )
    if len(out) != len(state_dict):
        raise KeyMismatchError(
            f"stripping {prefix!r} makes keys collide (the state dict holds both 'x' and '{prefix}x' forms); "
            "it mixes wrapped and unwrapped keys, fix the file or strip by hand"
        )
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        bare = prefix[:-1]
        rename: dict[str, str] = {}
        for name in meta:
            if name == "" and bare in meta:
                continue  # the wrapper's own entry; the wrapped module becomes the root
            if name == bare:
                rename[name] = ""
            elif name.startswith(prefix):
                rename[name] = name[len(prefix) :]
            else:
                rename[name] = name
        _rekey_metadata(state_dict, out, rename)  # type: ignore[arg-type]
    return out


def add_prefix(state_dict: Mapping[str, V], prefix: str = DDP_PREFIX) -> OrderedDict[str, V]:
    """Return a new state dict with ``prefix`` in front of every key (the form a DDP model expects).

    Local; no tensor is copied; ``_metadata`` follows the keys.

    Example::

        >>> list(dist_resume.add_prefix({"fc.weight": torch.zeros(2, 2)}))
        ['module.fc.weight']
    """
    _check_prefix(prefix)
    out: OrderedDict[str, V] = OrderedDict((prefix + k, v) for k, v in state_dict.items())
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        rename = {name: (prefix + name if name else prefix[:-1]) for name in meta}
        _rekey_metadata(state_dict, out, rename)  # type: ignore[arg-type]
        out._metadata[""] = {"version": 1}  # type: ignore[attr-defined]
        out._metadata.move_to_end("", last=False)  # type: ignore[attr-defined]
    return out


def _wrapper_chain(model: nn.Module) -> tuple[nn.Module, str]:
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    prefix = ""
    while True:
        if isinstance(model, (DistributedDataParallel, DataParallel)):
            model, prefix = model.module, prefix + DDP_PREFIX
        elif (inner := compiled_original(model)) is not None:
            model, prefix = inner, prefix + COMPILE_PREFIX
        else:
            return model, prefix


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under any nesting of DistributedDataParallel, DataParallel and torch.compile.

    Local.

    Example::

        >>> net = torch.nn.Linear(2, 2)
        >>> dist_resume.unwrap_model(torch.nn.DataParallel(net)) is net
        True
    """
    return _wrapper_chain(model)[0]


def wrapper_prefix(model: nn.Module) -> str:
    """The key prefix the wrappers around ``model`` add, e.g. ``'module._orig_mod.'``."""
    return _wrapper_chain(model)[1]


def canonical_key(key: str) -> str:
    """``key`` without ``_orig_mod.`` anywhere and without leading ``module.`` parts.

    Local. The one canonical form of a key or optimizer ``param_names`` entry: two keys name the
    same tensor when their canonical forms are equal (the last part is never dropped).

    Example::

        >>> dist_resume.canonical_key("_orig_mod.module.net._orig_mod.fc.weight")
        'net.fc.weight'
    """
    parts = [p for p in key.split(".") if p != "_orig_mod"]
    i = 0
    while i < len(parts) - 1 and parts[i] == "module":
        i += 1
    return ".".join(parts[i:])


def without_compile(key: str) -> str:
    """``key`` without torch.compile's ``_orig_mod`` components, wherever they sit (``a._orig_mod.b`` -> ``a.b``)."""
    if "_orig_mod" not in key:
        return key
    return ".".join(p for p in key.split(".") if p != "_orig_mod")


def canonical_state_dict(model: nn.Module) -> OrderedDict[str, torch.Tensor]:
    """``model.state_dict()`` keyed as the unwrapped module would key it (no wrapper prefixes)."""
    inner, _ = _wrapper_chain(model)
    sd = inner.state_dict()
    out: OrderedDict[str, torch.Tensor] = OrderedDict((without_compile(k), v) for k, v in sd.items())
    meta = getattr(sd, "_metadata", None)
    if meta is not None:
        out._metadata = OrderedDict((without_compile(k), v) for k, v in meta.items())  # type: ignore[attr-defined]
    return out


def model_key_map(model: nn.Module, keys: Iterable[str] | None = None) -> dict[str, str]:
    """Map the inner (unwrapped, compile-free) form of each of ``model``'s keys to the key itself."""
    _, prefix = _wrapper_chain(model)
    if keys is None:
        keys = model.state_dict().keys()
    out: dict[str, str] = {}
    for key in keys:
        inner = key[len(prefix) :] if key.startswith(prefix) else key
        out[without_compile(inner)] = key
    return out


def match_keys(saved: Iterable[str], targets: Mapping[str, str]) -> dict[str, str]:
    """Pair saved keys with target keys; ``targets`` maps inner forms to target keys.

    Saved keys lose ``_orig_mod.`` parts, then the number of leading ``module.`` parts (0..common
    count) that pairs the most keys is stripped. Returns ``{saved_key: target_key}`` for the pairs.
    """
    saved = list(saved)
    normal = [without_compile(k) for k in saved]
    common = min((_leading_module_count(k) for k in normal), default=0)
    best: dict[str, str] = {}
    for strip in range(common + 1):
        cut = len(DDP_PREFIX) * strip
        pairs = {}
        for key, inner in zip(saved, normal):
            target = targets.get(inner[cut:])
            if target is not None:
                pairs[key] = target
        if len(pairs) > len(best):
            best = pairs
        if len(best) == len(saved):
            break
    return best


def _leading_module_count(key: str) -> int:
    """How many ``module.`` prefixes ``key`` starts with (each must be followed by more key)."""
    i = 0
    while key.startswith(DDP_PREFIX, i * len(DDP_PREFIX)):
        i += 1
    return i


def prefix_style(keys: Iterable[str]) -> str:
    """Describe the wrapper prefixes on ``keys``: ``none``, ``module.``, ``_orig_mod.``, a nested chain, or ``mixed``."""
    styles = set()
    for key in keys:
        parts = key.split(".")
        i = 0
        while i < len(parts) - 1 and parts[i] in _WRAPPER_PARTS:
            i += 1
        styles.add(".".join(parts[:i]) + "." if i else "none")
        if len(styles) > 1:
            return "mixed"
    return styles.pop() if styles else "none"
