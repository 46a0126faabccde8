"""Pairing saved optimizer state with live parameters: group by group, or by name across regrouped groups."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch

from ..._core.errors import OptimizerStateMismatchError
from ..._core.log import log_rank0
from ..._core.text import preview
from ..prefix import canonical_key, match_keys

__all__ = [
    "FACTORED_KEYS",
    "saved_names",
    "match_in_groups",
    "regroup_by_name",
    "describe_groups",
    "check_state_shapes",
]

# state tensors whose shape legitimately differs from the parameter's
FACTORED_KEYS: Final = frozenset({"row_var", "col_var"})


def saved_names(saved_groups: Sequence[Mapping[str, Any]]) -> list[list[str]] | None:
    """Each saved group's ``param_names``, or None unless every group names each of its parameters."""
    names = []
    for g in saved_groups:
        own = g.get("param_names")
        if (
            not isinstance(own, (list, tuple))
            or len(own) != len(g["params"])
            or not all(isinstance(n, str) for n in own)
        ):
            return None
        names.append(list(own))
    return names


def match_in_groups(saved: list[list[str]], live: list[list[str]]) -> list[list[int]] | None:
    """For each group: the positions in the saved group, in the order of the live group's parameters.

    None when some group's parameters differ by name (the caller then matches across groups).
    """
    orders = []
    for names, saved_group in zip(live, saved):
        targets = {canonical_key(n): n for n in names}
        pairs = match_keys(saved_group, targets)
        if len(targets) != len(names) or len(pairs) != len(saved_group) or len(set(pairs.values())) != len(names):
            return None
        position = {pairs[n]: j for j, n in enumerate(saved_group)}
        orders.append([position[n] for n in names])
    return orders


def describe_groups(sizes: Sequence[int]) -> str:
    """``1 group of 4``, ``3 groups of 3+2+1``."""
    if len(sizes) == 1:
        return f"1 group of {sizes[0]}"
    return f"{len(sizes)} groups of {'+'.join(map(str, sizes))}"


def regroup_by_name(
    saved: Mapping[str, Any],
    names: list[list[str]],
    optimizer: torch.optim.Optimizer,
    live: list[list[str]],
    *,
    strict: bool,
    source: str,
) -> tuple[list[dict[str, Any]], dict[Any, torch.Tensor], dict[Any, Any]]:
    """Pair each live parameter with the saved state of the same name, whatever group either is in.

    Local. Returns the groups to load (the live groups' hyper-parameters, saved ids in the live
    order; parameters the file does not name get fresh ids), ``{saved id: live parameter}`` and the
    state entries that will be applied. Under ``strict`` every live parameter must be named in the
    file and every saved name must exist live; otherwise those are logged and left out.
    """
    kind = type(optimizer).__name__
    saved_groups = list(saved["param_groups"])
    flat_ids = [i for g in saved_groups for i in g["params"]]
    flat_saved = [n for group in names for n in group]
    flat_live = [n for group in live for n in group]
    targets = {canonical_key(n): n for n in flat_live}
    pairs = match_keys(flat_saved, targets)
    if len(targets) != len(flat_live) or len(set(pairs.values())) != len(pairs):
        twice = [n for n in flat_saved if flat_saved.count(n) > 1] or [n for n in flat_live if flat_live.count(n) > 1]
        raise OptimizerStateMismatchError(
            f"{source}: optimizer parameter names are not unique ({preview(sorted(set(twice)))}), "
            "so state cannot be matched by name; give each parameter once, under its model name"
        )
    sid_by_live = {pairs[n]: sid for n, sid in zip(flat_saved, flat_ids) if n in pairs}
    missing = [n for n in flat_live if n not in sid_by_live]
    unexpected = [n for n in flat_saved if n not in pairs]
    if not sid_by_live:
        raise OptimizerStateMismatchError(
            f"{source}: no parameter of the live {kind} is named in the file's optimizer state (file: "
            f"{preview(flat_saved, count=True)}; live: {preview(flat_live, count=True)}); "
            "this optimizer state is from another model"
        )
    differ = ", ".join(
        f"{where} ({preview(which, count=True)})"
        for where, which in (("not in checkpoint", missing), ("only in checkpoint", unexpected))
        if which
    )
    saved_sizes = [len(g["params"]) for g in saved_groups]
    live_sizes = [len(g) for g in live]
    if strict and (missing or unexpected):
        raise OptimizerStateMismatchError(
            f"{source}: the optimizer holds different parameters than the file (parameter group sizes: saved "
            f"{saved_sizes}, {kind} has {live_sizes}): {differ}; the model's parameters changed since the "
            "checkpoint was written (pass options=ResumeOptions(strict=False) to restore the state of the parameters "
            "both have; "
            "new ones start fresh)"
        )
    how = f"{describe_groups(saved_sizes)} params in the file, {describe_groups(live_sizes)} now"
    if saved_sizes == live_sizes and not (missing or unexpected):
        how += ", with parameters moved between groups"
    log_rank0(
        logging.WARNING,
        "%s: the optimizer's param groups changed (%s); each parameter's state is restored by name and the group "
        "hyper-parameters come from the live %s, not from the file",
        source,
        how,
        kind,
    )
    if missing or unexpected:
        log_rank0(logging.WARNING, "%s: optimizer state restored for the parameters both have; %s", source, differ)
    used = set(flat_ids)
    fresh = (i for i in range(len(used) + len(flat_live) + 1) if i not in used)
    new_groups: list[dict[str, Any]] = []
    live_by_saved_id: dict[Any, torch.Tensor] = {}
    for group, group_names in zip(optimizer.param_groups, live):
        ids = [sid_by_live[n] if n in sid_by_live else next(fresh) for n in group_names]
        new_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        live_by_saved_id.update(zip(ids, group["params"]))
    state = {sid: saved["state"][sid] for sid in sid_by_live.values() if saved["state"].get(sid)}
    return new_groups, live_by_saved_id, state


def check_state_shapes(
    state: Mapping[Any, Any], live_by_saved_id: dict[Any, torch.Tensor], names: Mapping[int, str], source: str
) -> None:
    """Raise unless each state tensor has its parameter's shape (``names``: ``id(parameter) -> name``)."""
    problems = []
    for sid, param in live_by_saved_id.items():
        for key, value in (state.get(sid) or {}).items():
            if (
                isinstance(value, torch.Tensor)
                and key != "step"
                and value.dim() > 0
                and key not in FACTORED_KEYS
                and value.shape != param.shape
            ):
                name = names.get(id(param), f"parameter #{sid}")
                problems.append(
                    f"state[{name}][{key!r}] has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
                )
    if problems:
        shown = preview(problems, sep="; ", quote=False)
        raise OptimizerStateMismatchError(
            f"{source}: optimizer state does not fit the parameters it would be paired with: {shown}; "
            "the parameters were reordered or reshaped since the checkpoint was written "
            "(build the optimizer from model.named_parameters() so state is matched by name)"
        )
