"""``train_state.pt``'s ``sharded_layout`` entry: what DCP does not keep of a payload, typed before anyone reads it.

A sharded checkpoint folder's ``train_state.pt`` records the payload's key order and, for the model and the EMA,
their keys' order and ``state_dict._metadata`` (:mod:`~dist_resume._foreign.sharded` writes and reads it). Both the
torch path and ``dist-resume list``'s torch-free one check it with :func:`layout_problem` before using it.

Torch-free: this module imports nothing but the standard library.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

__all__ = ["SHARDED_LAYOUT", "LAYOUT_FIELDS", "layout_problem", "held_keys", "lost_keys_problem"]

SHARDED_LAYOUT: Final = "sharded_layout"  # train_state.pt's record of what DCP does not keep
# each field and the type it holds (or None): the payload's key order, and per part its keys and _metadata
LAYOUT_FIELDS: Final = {
    "order": list,
    "model_keys": list,
    "ema_keys": list,
    "model_metadata": dict,
    "ema_metadata": dict,
}


def layout_problem(train_state: Any) -> str | None:
    """What is wrong with ``train_state``'s ``sharded_layout`` (absent, not a dict, a field of another type, a key
    list holding other than names), or None. Local."""
    if not isinstance(train_state, Mapping) or SHARDED_LAYOUT not in train_state:
        return f"it has no {SHARDED_LAYOUT} entry"
    layout = train_state[SHARDED_LAYOUT]
    if not isinstance(layout, dict):
        return f"its {SHARDED_LAYOUT} is {type(layout).__name__}, not a dict"
    wrong = []
    for name, kind in LAYOUT_FIELDS.items():
        value = layout.get(name)
        if value is not None and not (isinstance(value, kind) and (kind is dict or all(type(k) is str for k in value))):
            wrong.append(name)
    return f"its {SHARDED_LAYOUT} holds {wrong} of another type than a save writes" if wrong else None


def held_keys(places: Iterable[tuple[str | int, ...]]) -> dict[str, set[str]]:
    """The keys the DCP state holds under each top-level entry (``model``: its state dict's keys), from the places
    of ``.metadata``'s entries (``("model", "l1.weight")``). Local."""
    held: dict[str, set[str]] = {}
    for place in places:
        if len(place) == 2 and type(place[0]) is str and type(place[1]) is str:
            held.setdefault(place[0], set()).add(place[1])
    return held


def lost_keys_problem(layout: Mapping[str, Any], held: Mapping[str, Collection[str]]) -> str | None:
    """Which model and EMA keys ``layout`` (a checked ``sharded_layout``) lists that the DCP state does not hold
    (``held``: its keys under each top-level entry), or None. A key the save wrote that ``.metadata`` no longer
    declares is damage, not a model that does not fit. DCP drops an empty dict, which only a module's
    ``_extra_state`` can be: such a key may be absent. Local."""
    for part in ("model", "ema"):
        if part not in held:  # the part itself: the manifest's contents say whether it must be there
            continue
        keys = layout.get(f"{part}_keys") or ()
        lost = [k for k in keys if k not in held[part] and not k.endswith("_extra_state")]
        if lost:
            shown = ", ".join(map(repr, lost[:3])) + (f" and {len(lost) - 3} more" if len(lost) > 3 else "")
            return f"its {SHARDED_LAYOUT} lists {part} keys the DCP files do not hold ({shown})"
    return None
