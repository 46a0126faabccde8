"""Model keys and optimizer ``param_names`` in the single-process or the DDP form, rewritten in place."""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import MutableMapping
from typing import Any

from .._core.errors import KeyMismatchError
from .._core.text import preview
from .._state.optim.keys import check_optimizer_form
from .._state.prefix import DDP_PREFIX, canonical_key

__all__ = ["KeyForm", "target_key", "rekey_state_dict", "rekey_param_names"]


class KeyForm(enum.Enum):
    """The key form to convert to: what ``model.state_dict()`` gives for a plain model, or for DDP around it."""

    SINGLE = "single"
    DDP = "ddp"


def target_key(key: str, to: KeyForm) -> str:
    """``key`` in the target form: canonical (no ``module.``/``_orig_mod.``), plus ``module.`` for DDP."""
    inner = canonical_key(key)
    return DDP_PREFIX + inner if to is KeyForm.DDP else inner


def _module_path(path: str, to: KeyForm) -> str:
    """A ``_metadata`` module path (``''`` is the root) in the target form."""
    inner = target_key(path + "._", KeyForm.SINGLE)[:-2] if path else ""
    if to is KeyForm.SINGLE:
        return inner
    return DDP_PREFIX[:-1] + ("." + inner if inner else "")


def _convert_metadata(meta: MutableMapping[str, Any], to: KeyForm) -> OrderedDict[str, Any]:
    out: OrderedDict[str, Any] = OrderedDict()
    if to is KeyForm.DDP:
        out[""] = {"version": 1}  # the wrapper's own entry, as add_prefix writes it
    depth: dict[str, int] = {}
    for name, value in meta.items():
        new = _module_path(name, to)
        if new in depth and depth[new] > len(name):
            continue  # a wrapper's entry and its inner module's map to one path: keep the inner module's
        out[new], depth[new] = value, len(name)
    return out


def rekey_state_dict(state_dict: MutableMapping[str, Any], to: KeyForm, source: str) -> int:
    """Re-key ``state_dict`` in place (it is the object inside the checkpoint); return how many keys changed."""
    items = list(state_dict.items())
    new_keys = [target_key(k, to) for k, _ in items]
    if len(set(new_keys)) != len(new_keys):
        seen: dict[str, str] = {}
        clashes = []
        for (old, _), new in zip(items, new_keys):
            if new in seen:
                clashes.append(f"{seen[new]!r} and {old!r}")
            seen.setdefault(new, old)
        raise KeyMismatchError(
            f"{source}: model keys collide after conversion ({preview(clashes, 3, sep='; ', quote=False)}): the state dict mixes wrapped and unwrapped copies of the same "
            "parameters; remove the duplicates first"
        )
    meta = getattr(state_dict, "_metadata", None)
    state_dict.clear()
    state_dict.update(zip(new_keys, (v for _, v in items)))
    if meta is not None:
        state_dict._metadata = _convert_metadata(meta, to)  # type: ignore[attr-defined]
    return sum(old != new for (old, _), new in zip(items, new_keys))


def rekey_param_names(optimizer: Any, to: KeyForm, source: str) -> int:
    """Re-key every group's ``param_names`` of a saved optimizer state in place, ``to`` the form; how many names.

    An entry without ``param_groups`` (none, several optimizers in a list, a dict of something else) has none
    to re-key; one with groups not in ``Optimizer.state_dict()``'s form raises :class:`OptimizerStateMismatchError`.
    """
    if not isinstance(optimizer, MutableMapping) or "param_groups" not in optimizer:
        return 0
    check_optimizer_form(optimizer, source)
    count = 0
    for group in optimizer["param_groups"]:
        if "param_names" in group:
            group["param_names"] = [target_key(n, to) for n in group["param_names"]]
            count += len(group["param_names"])
    return count
