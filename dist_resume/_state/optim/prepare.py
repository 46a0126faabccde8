"""Saved optimizer state matched to a live optimizer: the canonical ``param_names`` a save writes, and saved state
validated and re-keyed into the state dict the live optimizer's ``load_state_dict`` takes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import torch
from torch import nn

from ..._core.errors import OptimizerStateMismatchError
from ..._core.text import article
from ..prefix import canonical_key, unwrap_model, without_compile
from .keys import (
    GROUP_BOOKKEEPING,
    NOT_HYPERPARAMETERS,
    check_state_keys,
    normalize_optimizer_state,
    optimizer_form_problem,
)
from .match import check_state_shapes, match_in_groups, regroup_by_name, saved_names

__all__ = ["param_names", "prepare_optimizer_state", "canonical_optimizer_state"]

# keys LR schedulers (OneCycleLR, CyclicLR, ...) add to param groups
_SCHEDULER_KEYS: Final = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "momentum", "betas"}
)


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` as the unwrapped model names it (no ``module.``/``_orig_mod.``)."""
    return {id(p): without_compile(name) for name, p in unwrap_model(model).named_parameters()}


def _live_names(optimizer: torch.optim.Optimizer, model: nn.Module | None) -> list[list[str]] | None:
    by_id = param_names(model) if model is not None else {}
    groups = []
    for group in optimizer.param_groups:
        own = group.get("param_names")
        names = []
        for i, p in enumerate(group["params"]):
            name = by_id.get(id(p)) or (own[i] if own else None)
            if name is None:
                return None
            names.append(name)
        groups.append(names)
    return groups


def canonical_optimizer_state(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> dict[str, Any]:
    """``optimizer.state_dict()`` with canonical ``param_names`` in every group (from ``model`` when given)."""
    sd = optimizer.state_dict()
    names = _live_names(optimizer, model)
    groups = []
    for i, group in enumerate(sd["param_groups"]):
        group = dict(group)
        if names is not None:
            group["param_names"] = [canonical_key(n) for n in names[i]]
        elif "param_names" in group:
            group["param_names"] = [canonical_key(n) for n in group["param_names"]]
        groups.append(group)
    return {"state": sd["state"], "param_groups": groups}


def _fail(msg: str) -> OptimizerStateMismatchError:
    return OptimizerStateMismatchError(msg)


def prepare_optimizer_state(
    saved: Any,
    optimizer: torch.optim.Optimizer,
    model: nn.Module | None = None,
    *,
    source: str = "checkpoint",
    strict: bool = True,
) -> dict[str, Any]:
    """Validate saved optimizer state against ``optimizer`` and return a state dict ready to load.

    Local; changes nothing. State keyed by digit strings or by parameter names is re-keyed
    (:func:`~.keys.normalize_optimizer_state`); state that then fits no parameter of the saved groups is
    refused. Checks the optimizer kind (from the group hyper-parameters), the group structure,
    ``param_names`` after prefix normalisation (a reordered module is re-matched by name) and every
    per-parameter state tensor's shape against the parameter it will belong to.

    When the groups changed (count, sizes, or which parameter is in which) and both sides have
    parameter names, each parameter's state is matched by name into its live group, the live
    groups' hyper-parameters are kept, and a WARNING says so; ``strict=False`` then also lets live
    parameters the file does not name start fresh and drops saved names the model lacks.

    The result loads with ``optimizer.load_state_dict``; its ``state`` holds exactly the entries that
    will be applied (:func:`~.keys.state_coverage` counts them).

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.AdamW(model.named_parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> split = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias], "weight_decay": 0.0}])
        >>> split.load_state_dict(prepare_optimizer_state(opt.state_dict(), split, model))
    """
    problem = optimizer_form_problem(saved)
    if problem is not None:
        raise _fail(f"{source}: the optimizer entry is not an optimizer state dict: it {problem}")
    saved = normalize_optimizer_state(saved)
    check_state_keys(saved, source)
    groups, saved_groups = optimizer.param_groups, list(saved["param_groups"])
    for i, sgroup in enumerate(saved_groups):
        params = sgroup.get("params") if isinstance(sgroup, Mapping) else None
        if not (isinstance(params, (list, tuple)) and all(isinstance(p, (int, str)) for p in params)):
            raise _fail(
                f"{source}: saved optimizer param group {i} is not one Optimizer.state_dict() writes (no list of "
                "parameter ids under 'params'); the checkpoint is damaged or was edited: resume from another one"
            )
    _check_kind(groups, saved_groups, type(optimizer).__name__, source)
    names, live = saved_names(saved_groups), _live_names(optimizer, model)
    sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved_groups]
    orders: list[list[int]] | None = None
    if sizes == saved_sizes:
        identity = [list(range(n)) for n in sizes]
        orders = identity if names is None or live is None else match_in_groups(names, live)
    if orders is not None:
        new_groups, live_by_saved_id = _in_groups(saved_groups, groups, orders)
        state = {sid: entry for sid, entry in saved["state"].items() if entry}
    elif names is None or live is None:
        raise _fail(_refusal(saved_sizes, sizes, type(optimizer).__name__, source, names is None))
    else:
        new_groups, live_by_saved_id, state = regroup_by_name(
            saved, names, optimizer, live, strict=strict, source=source
        )
    if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS keeps flat vectors under its first parameter
        check_state_shapes(state, live_by_saved_id, param_names(model) if model is not None else {}, source)
    return {"state": state, "param_groups": new_groups}


def _check_kind(groups: list[dict[str, Any]], saved_groups: list[Any], kind: str, source: str) -> None:
    """Refuse state from another optimizer class: hyper-parameters it does not use, and lacking its own."""
    for i, sgroup in enumerate(saved_groups):
        group = groups[min(i, len(groups) - 1)]
        live_keys = set(group) - NOT_HYPERPARAMETERS
        saved_keys = set(sgroup) - NOT_HYPERPARAMETERS
        extra, absent = saved_keys - live_keys - _SCHEDULER_KEYS, live_keys - saved_keys
        if extra and absent:
            raise _fail(
                f"{source}: saved optimizer state is not from {article(kind)}: group {i} has hyper-parameters "
                f"{sorted(extra)} that {kind} does not use and lacks {sorted(absent)}; "
                "build the same optimizer class as the run that saved it"
            )


def _refusal(saved_sizes: list[int], sizes: list[int], kind: str, source: str, file_unnamed: bool) -> str:
    if len(saved_sizes) != len(sizes):
        found = f"saved optimizer has {len(saved_sizes)} parameter group(s), {kind} has {len(sizes)}"
    else:
        found = f"parameter group sizes differ: saved {saved_sizes}, {kind} has {sizes}"
    if file_unnamed:
        how = (
            "the file stores no parameter names to match its state by, so build the optimizer with the same "
            "param groups as the run that saved it (files saved with dist_resume, or from an optimizer built "
            "from model.named_parameters(), store names and can be regrouped)"
        )
    else:
        how = (
            "the live optimizer's parameters have no names to match the file's by: pass the model, or build "
            "the optimizer from model.named_parameters()"
        )
    return f"{source}: {found}; {how}"


def _in_groups(
    saved_groups: list[Any], groups: list[dict[str, Any]], orders: list[list[int]]
) -> tuple[list[dict[str, Any]], dict[Any, torch.Tensor]]:
    """Saved groups (their hyper-parameters, torch's rule) with ids in the live order; ``{saved id: parameter}``."""
    new_groups = []
    live_by_saved_id: dict[Any, torch.Tensor] = {}
    for group, sgroup, order in zip(groups, saved_groups, orders):
        ids = [sgroup["params"][j] for j in order]
        new_group = {k: v for k, v in sgroup.items() if k not in GROUP_BOOKKEEPING}
        new_group["params"] = ids
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        new_groups.append(new_group)
        live_by_saved_id.update(zip(ids, group["params"]))
    return new_groups, live_by_saved_id
