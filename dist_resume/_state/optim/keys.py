"""How saved optimizer state is keyed: re-keying the forms other tools write, refusing state that fits no parameter."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..._core.errors import OptimizerStateMismatchError
from ..._core.tensor_kind import odd_tensors
from ..._core.text import described, preview

__all__ = [
    "GROUP_BOOKKEEPING",
    "optimizer_form_problem",
    "check_optimizer_form",
    "NOT_HYPERPARAMETERS",
    "normalize_optimizer_state",
    "optimizer_by_name",
    "unfit_state_keys",
    "check_state_keys",
    "state_coverage",
    "digit_id",
]

GROUP_BOOKKEEPING: Final = frozenset({"params", "param_names"})  # a param group's keys that are no hyperparameter
# ... and the initial_lr an LR scheduler writes into each group: neither belongs to the optimizer's class
NOT_HYPERPARAMETERS: Final = GROUP_BOOKKEEPING | {"initial_lr"}


_LIST: Final = (list, tuple)
_DIGITS: Final = re.compile(r"[0-9]{1,19}")  # what torch.load gives back for a list (a tuple where a user built one)


def _an_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def digit_id(key: Any) -> int | None:
    """The parameter id a digit-string state key names (``'3'``: what ``dcp_to_torch_save`` writes, FACTS 21), or
    None: ASCII digits only, at most 19 (``str.isdigit`` takes ``'²'``, which ``int()`` refuses, and an id of
    thousands of digits is more than ``int()`` converts)."""
    return int(key) if isinstance(key, str) and _DIGITS.fullmatch(key) else None


def optimizer_form_problem(osd: Any) -> str | None:
    """What keeps ``osd`` from being in ``Optimizer.state_dict()``'s form (or DSD's, keyed by name), or None. Local.

    The form every reader of a saved optimizer relies on: ``{"state": {id: {...}}, "param_groups": [{"params":
    [id, ...], ...}]}``, each id an int or a str and listed once, each state entry a mapping of dense tensors (a meta
    stand-in counts) and other values, each group's entries named by strings, and a group's ``param_names`` (where it
    has one) one string per id. Said as "is ..."/"has ...".

    Example::

        >>> optimizer_form_problem({"state": {}, "param_groups": [{"params": [0, 0]}]})
        'lists parameter ids more than once ([0])'
    """
    groups = osd.get("param_groups") if isinstance(osd, Mapping) else None
    state = osd.get("state") if isinstance(osd, Mapping) else None
    if not isinstance(state, Mapping) or not isinstance(groups, _LIST):
        found = f"a mapping with keys {sorted(map(str, osd))}" if isinstance(osd, Mapping) else type(osd).__name__
        return f"is {found}, not {{'state': {{...}}, 'param_groups': [...]}}"
    if bad := [str(k)[:40] for k, v in state.items() if not _an_id(k) or not isinstance(v, Mapping)]:
        return f"has per-parameter entries that are not mappings under parameter ids ({preview(bad)})"
    if not all(isinstance(g, Mapping) and isinstance(g.get("params"), _LIST) for g in groups):
        return "has parameter groups without a list of parameter ids under 'params'"
    if odd := [f"group {i} key {described(k, 40)}" for i, g in enumerate(groups) for k in g if not isinstance(k, str)]:
        return f"has group entries not named by a string ({preview(odd, quote=False)})"
    if kinds := odd_tensors(state, "state"):
        return f"has state tensors that are not dense ({preview(kinds, quote=False)})"
    ids = [p for g in groups for p in g["params"]]
    if odd := [p for p in ids if not _an_id(p)]:
        return f"has parameter ids that are neither ints nor strings ({preview(map(repr, odd), quote=False)})"
    if twice := sorted((p for p, n in Counter(ids).items() if n > 1), key=str):
        return f"lists parameter ids more than once ({preview(twice)})"
    for i, group in enumerate(groups):
        names = group.get("param_names", ())
        if "param_names" in group and (
            not isinstance(names, _LIST)
            or len(names) != len(group["params"])
            or not all(isinstance(n, str) for n in names)
        ):
            return f"has group {i} 'param_names' that are not one string per parameter id"
    return None


def check_optimizer_form(osd: Any, source: str) -> None:
    """Raise :class:`OptimizerStateMismatchError` when :func:`optimizer_form_problem` finds one. Local."""
    problem = optimizer_form_problem(osd)
    if problem is not None:
        raise OptimizerStateMismatchError(
            f"{source}: the optimizer state {problem}; it was not written by Optimizer.state_dict() (or was damaged): "
            "use another checkpoint, or leave the optimizer out (resume: allow_missing=('optimizer',) and no "
            "optimizer)"
        )


def _group_ids(osd: Mapping[str, Any]) -> list[Any]:
    return [p for g in osd["param_groups"] for p in g["params"]]


def normalize_optimizer_state(osd: Any) -> Any:
    """Optimizer state keyed as ``Optimizer.load_state_dict`` expects, or ``osd`` unchanged. Local.

    Digit-string state keys (what torch's ``dcp_to_torch_save`` writes, FACTS 21) become ints when
    that is unambiguous: every state key is a digit string and every one names an int id of the
    groups. DSD's FQN form (state keys and the groups' ``params`` are parameter names) becomes
    positions, with the names kept as ``param_names``. Anything else is returned as it is (the
    caller refuses state that fits no parameter: :func:`check_state_keys`).

    Example::

        >>> normalize_optimizer_state({"state": {"0": {}}, "param_groups": [{"params": [0]}]})["state"]
        {0: {}}
    """
    if not (isinstance(osd, Mapping) and isinstance(osd.get("state"), Mapping)):
        return osd
    groups = osd.get("param_groups")
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, Mapping) and "params" in g for g in groups):
        return osd
    params = _group_ids(osd)
    state = osd["state"]
    if params and all(type(p) is int for p in params):
        ids = set(params)
        as_ids = [digit_id(k) for k in state]
        if not state or not all(i is not None and i in ids for i in as_ids):
            return osd
        return {**osd, "state": dict(zip(as_ids, state.values()))}
    if params and all(isinstance(p, str) for p in params) and len(set(params)) == len(params):
        position = {name: i for i, name in enumerate(params)}
        new_groups = []
        for g in groups:
            new_groups.append({**g, "params": [position[n] for n in g["params"]], "param_names": list(g["params"])})
        return {**osd, "state": {position.get(k, k): v for k, v in state.items()}, "param_groups": new_groups}
    return osd


def optimizer_by_name(osd: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """``osd`` (``Optimizer.state_dict()``'s form) keyed as DSD's ``get_optimizer_state_dict`` keys it. Local.

    ``names`` holds one parameter name per id, in the groups' order: state entries and each group's
    ``params`` become those names, ``param_names`` (where a group has it) the same list; every other
    group entry stays, in its place. :func:`normalize_optimizer_state` turns it back.

    Example::

        >>> optimizer_by_name({"state": {0: {"step": 1}}, "param_groups": [{"params": [0], "lr": 0.1}]}, ["w"])
        {'state': {'w': {'step': 1}}, 'param_groups': [{'params': ['w'], 'lr': 0.1}]}
    """
    ids = _group_ids(osd)
    if len(names) != len(ids) or len(set(names)) != len(names):
        raise OptimizerStateMismatchError(
            f"the optimizer's {len(ids)} parameters cannot be keyed by the {len(names)} names given "
            f"({len(set(names))} distinct); each parameter needs a name of its own"
        )
    fqn = dict(zip(ids, names))
    groups = []
    for g in osd["param_groups"]:
        params = [fqn[p] for p in g["params"]]
        groups.append({k: list(params) if k in GROUP_BOOKKEEPING else v for k, v in g.items()})  # order kept
    return {"state": {fqn[k]: v for k, v in osd["state"].items() if k in fqn}, "param_groups": groups}


def unfit_state_keys(osd: Mapping[str, Any]) -> list[Any]:
    """The keys of ``osd["state"]`` that name no parameter of ``osd["param_groups"]``. Local.

    A digit string whose int is a group id (and not a state key itself) fits: normalising makes it
    one. ``inspect`` warns about these; :func:`check_state_keys` refuses them.
    """
    ids = set(_group_ids(osd))
    state = osd["state"]

    def fits(key: Any) -> bool:
        if key in ids:
            return True
        number = digit_id(key)
        return number is not None and number in ids and number not in state

    return [k for k in state if not fits(k)]


def check_state_keys(osd: Mapping[str, Any], source: str) -> None:
    """Raise :class:`OptimizerStateMismatchError` unless every state entry belongs to a parameter of the groups.

    Local. Torch's ``load_state_dict`` would keep such entries under their own keys where no step
    reads them, and report nothing: a silent half-restore.
    """
    ids = set(_group_ids(osd))
    bad = unfit_state_keys(osd) or [k for k in osd["state"] if k not in ids]
    if not bad:
        return
    entries = "entry fits" if len(bad) == 1 else "entries fit"
    digits = " (digit-string keys are read as ints only when all of them are and each names a group id)"
    raise OptimizerStateMismatchError(
        f"{source}: {len(bad)} optimizer state {entries} no parameter of the saved param_groups: "
        f"{preview(bad)}; the groups list {preview(_group_ids(osd))}"
        f"{digits if any(digit_id(k) is not None for k in bad) else ''}. "
        "Nothing was restored. Key the file's 'state' by the ids in its 'param_groups' "
        "(the form Optimizer.state_dict() writes), or resume without the optimizer"
    )


def state_coverage(prepared: Mapping[str, Any]) -> tuple[int, int]:
    """``(parameters that get state, parameters)`` for a state dict from ``prepare_optimizer_state``. Local.

    Example::

        >>> state_coverage({"state": {0: {"step": 1}}, "param_groups": [{"params": [0, 1]}]})
        (1, 2)
    """
    ids = _group_ids(prepared)
    state = prepared["state"]
    return sum(1 for i in ids if state.get(i)), len(ids)
