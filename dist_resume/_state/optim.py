"""Optimizer state: placement on the parameters' devices, and matching saved state to parameters."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

import torch
from torch import nn

from .._core.errors import OptimizerStateMismatchError
from .._core.text import article, preview
from .._core.tree import map_tensors
from .prefix import _without_compile, canonical_key, match_keys, unwrap_model

__all__ = [
    "optimizer_to",
    "step_on_param_device",
    "param_names",
    "prepare_optimizer_state",
    "canonical_optimizer_state",
]

_GROUP_BOOKKEEPING: Final = frozenset({"params", "param_names", "initial_lr"})
# keys LR schedulers (OneCycleLR, CyclicLR, ...) add to param groups
_SCHEDULER_KEYS: Final = frozenset(
    {"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum", "momentum", "betas"}
)
# state tensors whose shape legitimately differs from the parameter's
_FACTORED_KEYS: Final = frozenset({"row_var", "col_var"})


def step_on_param_device(group: Mapping[str, Any]) -> bool:
    """torch's policy: ``step`` lives on the parameter's device only for fused or capturable groups."""
    return bool(group.get("fused")) or bool(group.get("capturable"))


def _params_with_groups(optimizer: torch.optim.Optimizer) -> Iterator[tuple[torch.Tensor, dict[str, Any]]]:
    for group in optimizer.param_groups:
        for p in group["params"]:
            yield p, group


def optimizer_to(optimizer: torch.optim.Optimizer, device: torch.device | str | None = None) -> torch.optim.Optimizer:
    """Move each per-parameter state tensor onto its parameter's device (or onto ``device``).

    Local. Follows torch's own policy: ``step`` stays on the CPU unless the group is ``fused`` or
    ``capturable`` (a CUDA ``step`` on a plain Adam would force a host sync per parameter per step),
    dtypes never change, and a tensor already in place is not copied. Returns ``optimizer``.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> dist_resume.optimizer_to(opt) is opt   # after model.to(device)
        True
    """
    target = torch.device(device) if device is not None else None
    for p, group in _params_with_groups(optimizer):
        state = optimizer.state.get(p)
        if not state:
            continue
        where = target or p.device
        for key, value in state.items():
            if key == "step" and not step_on_param_device(group):
                dest = torch.device("cpu")
            else:
                dest = where
            moved = _moved(value, dest)
            if moved is not value:
                state[key] = moved
    return optimizer


def _moved(value: Any, dest: torch.device) -> Any:
    """``value`` with every tensor in it on ``dest``; the same object when nothing had to move.

    Recurses into lists, tuples and dicts like torch's own ``load_state_dict`` (LBFGS keeps its
    history as lists of tensors).
    """
    return map_tensors(value, lambda t: t if t.device == dest else t.to(dest), share_unchanged=True)


def param_names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> name`` as the unwrapped model names it (no ``module.``/``_orig_mod.``)."""
    return {id(p): _without_compile(name) for name, p in unwrap_model(model).named_parameters()}


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
    saved: Any, optimizer: torch.optim.Optimizer, model: nn.Module | None = None, *, source: str = "checkpoint"
) -> dict[str, Any]:
    """Validate saved optimizer state against ``optimizer`` and return a state dict ready to load.

    Local; changes nothing. Checks group count and sizes, the optimizer kind (from the group
    hyper-parameters), ``param_names`` after prefix normalisation (a reordered module is re-matched
    by name) and every per-parameter state tensor's shape against the parameter it will belong to.
    """
    if not (
        isinstance(saved, Mapping)
        and isinstance(saved.get("state"), Mapping)
        and isinstance(saved.get("param_groups"), (list, tuple))
    ):
        raise _fail(f"{source}: the optimizer entry is not an optimizer state dict (no 'state'/'param_groups')")
    groups, saved_groups = optimizer.param_groups, list(saved["param_groups"])
    kind = type(optimizer).__name__
    for i, sgroup in enumerate(saved_groups):
        params = sgroup.get("params") if isinstance(sgroup, Mapping) else None
        if not (isinstance(params, (list, tuple)) and all(isinstance(p, (int, str)) for p in params)):
            raise _fail(
                f"{source}: saved optimizer param group {i} is not one Optimizer.state_dict() writes (no list of "
                "parameter ids under 'params'); the checkpoint is damaged or was edited: resume from another one"
            )
    if len(groups) != len(saved_groups):
        raise _fail(
            f"{source}: saved optimizer has {len(saved_groups)} parameter group(s), {kind} has {len(groups)}; "
            "build the optimizer with the same param groups as the run that saved it"
        )
    for i, (group, sgroup) in enumerate(zip(groups, saved_groups)):
        live_keys = set(group) - _GROUP_BOOKKEEPING
        saved_keys = set(sgroup) - _GROUP_BOOKKEEPING
        extra, absent = saved_keys - live_keys - _SCHEDULER_KEYS, live_keys - saved_keys
        if extra and absent:
            raise _fail(
                f"{source}: saved optimizer state is not from {article(kind)}: group {i} has hyper-parameters "
                f"{sorted(extra)} that {kind} does not use and lacks {sorted(absent)}; "
                "build the same optimizer class as the run that saved it"
            )
    sizes, saved_sizes = [len(g["params"]) for g in groups], [len(g["params"]) for g in saved_groups]
    if sizes != saved_sizes:
        raise _fail(
            f"{source}: parameter group sizes differ: saved {saved_sizes}, {kind} has {sizes}; "
            "the model or the param groups changed since the checkpoint was written"
        )
    orders = _match_by_name(saved_groups, _live_names(optimizer, model), source)
    new_groups = []
    live_by_saved_id: dict[Any, torch.Tensor] = {}
    for group, sgroup, order in zip(groups, saved_groups, orders):
        ids = [sgroup["params"][j] for j in order]
        new_group = {k: v for k, v in sgroup.items() if k not in ("params", "param_names")}
        new_group["params"] = ids
        if "param_names" in group:
            new_group["param_names"] = list(group["param_names"])
        new_groups.append(new_group)
        live_by_saved_id.update(zip(ids, group["params"]))
    if not isinstance(optimizer, torch.optim.LBFGS):  # LBFGS keeps flat vectors under its first parameter
        _check_state_shapes(saved["state"], live_by_saved_id, model, source)
    return {"state": saved["state"], "param_groups": new_groups}


def _match_by_name(saved_groups: list[Any], live: list[list[str]] | None, source: str) -> list[list[int]]:
    """For each group: the positions in the saved group, in the order of the live group's parameters."""
    identity = [list(range(len(g["params"]))) for g in saved_groups]
    if live is None or not all("param_names" in g for g in saved_groups):
        return identity
    orders = []
    for i, (names, sgroup) in enumerate(zip(live, saved_groups)):
        saved_names = list(sgroup["param_names"])
        pairs = match_keys(saved_names, {canonical_key(n): n for n in names})
        if len(pairs) != len(saved_names) or len(set(pairs.values())) != len(names):
            missing = sorted(set(names) - set(pairs.values()))
            unexpected = sorted(set(saved_names) - set(pairs))
            raise _fail(
                f"{source}: optimizer group {i} holds different parameters: not in checkpoint "
                f"({preview(missing, count=True)}), only in checkpoint ({preview(unexpected, count=True)}); "
                "the model's parameters changed since the checkpoint was written"
            )
        position = {pairs[n]: j for j, n in enumerate(saved_names)}
        orders.append([position[n] for n in names])
    return orders


def _check_state_shapes(
    state: Mapping[Any, Any], live_by_saved_id: dict[Any, torch.Tensor], model: nn.Module | None, source: str
) -> None:
    names = param_names(model) if model is not None else {}
    problems = []
    for sid, param in live_by_saved_id.items():
        for key, value in (state.get(sid) or {}).items():
            if (
                isinstance(value, torch.Tensor)
                and key != "step"
                and value.dim() > 0
                and key not in _FACTORED_KEYS
                and value.shape != param.shape
            ):
                name = names.get(id(param), f"parameter #{sid}")
                problems.append(
                    f"state[{name}][{key!r}] has shape {tuple(value.shape)}, the parameter {tuple(param.shape)}"
                )
    if problems:
        shown = preview(problems, sep="; ", quote=False)
        raise _fail(
            f"{source}: optimizer state does not fit the parameters it would be paired with: {shown}; "
            "the parameters were reordered or reshaped since the checkpoint was written "
            "(build the optimizer from model.named_parameters() so state is matched by name)"
        )
