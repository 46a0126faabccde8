"""What ``dist-resume inspect`` says about a saved optimizer: its class, groups, state, and what resume would do with it."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from ..._core.errors import OptimizerStateMismatchError
from ..._core.text import preview
from ..._state.optim.keys import (
    GROUP_BOOKKEEPING,
    NOT_HYPERPARAMETERS,
    check_state_keys,
    normalize_optimizer_state,
    optimizer_form_problem,
    unfit_state_keys,
)
from ..._state.optim.match import FACTORED_KEYS
from ..._state.optim.placement import step_on_param_device
from ..._state.prefix import canonical_key, prefix_style
from .._common import dtype_name, jsonable
from ._sources import StorageOf, summarize_tensors

__all__ = ["describe_optimizer", "optimizer_kind"]

# what a group may hold that says nothing about its optimizer's class (OneCycleLR and CyclicLR add these too)
_NOT_KIND_KEYS = NOT_HYPERPARAMETERS | {"max_lr", "min_lr", "max_momentum", "base_momentum"}


@functools.lru_cache(maxsize=1)
def _optimizer_signatures() -> dict[str, tuple[frozenset[str], Any]]:
    """Each ``torch.optim`` class's hyper-parameter names (and decoupled_weight_decay), from a live instance."""
    out = {}
    for name in sorted(dir(torch.optim)):
        cls: Any = getattr(torch.optim, name)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
            make: Any = cls
            try:
                opt = make([torch.nn.Parameter(torch.zeros(2, 2))], lr=0.01)
            except Exception:  # optimizers with required arguments or constraints: not recognisable
                continue
            out[name] = (frozenset(opt.defaults), opt.defaults.get("decoupled_weight_decay"))
    return out


def optimizer_kind(groups: list[Any]) -> str | None:
    """The ``torch.optim`` class whose hyper-parameters the saved param groups carry, or None."""
    if not groups or not isinstance(groups[0], Mapping):
        return None
    keys = frozenset(groups[0]) - _NOT_KIND_KEYS
    best: list[tuple[int, int, str]] = []
    for name, (known, decoupled) in _optimizer_signatures().items():
        if decoupled is not None and groups[0].get("decoupled_weight_decay", decoupled) != decoupled:
            continue
        if keys - known - {"momentum", "betas", "initial_lr"}:
            continue  # the group has hyper-parameters this class does not use (schedulers may add momentum/betas)
        best.append((len(known - keys), len(keys - known), name))
    return min(best)[2] if best else None


def describe_optimizer(
    opt: Any, storage_of: StorageOf, model: Mapping[str, Any], meta: Mapping[str, Any], warnings: list[str]
) -> dict[str, Any] | None:
    """The ``optimizer`` entry of the inspect report (None when the checkpoint has none). Local.

    Appends to ``warnings`` what resume or the first ``step()`` would trip over: state that fits no
    parameter, shapes no parameter has, accelerator ``step`` tensors, prefixes that differ from the model's.
    """
    if opt is None:
        return None
    problem = optimizer_form_problem(opt)
    if problem is not None:
        warnings.append(
            f"the optimizer entry {problem}: it is not an optimizer state dict as Optimizer.state_dict() writes it, "
            "and resume refuses it (OptimizerStateMismatchError)"
        )
        return {"kind": None}
    _state_key_warning(opt, warnings)
    opt = normalize_optimizer_state(opt)  # what resume reads: digit strings as ids, DSD's names as positions
    groups, state = list(opt["param_groups"]), opt["state"]
    names = [n for g in groups for n in (g.get("param_names") or [])] if all("param_names" in g for g in groups) else []
    ids = [i for g in groups for i in g.get("params", [])]
    where: Counter[str] = Counter()
    step_dtypes: Counter[str] = Counter()
    keys: set[str] = set()
    for per_param in state.values():
        if not isinstance(per_param, Mapping):
            continue
        keys.update(map(str, per_param))
        step = per_param.get("step")
        if isinstance(step, torch.Tensor):
            info = storage_of(step)
            where[info.location if info else "meta"] += 1
            step_dtypes[dtype_name(step.dtype)] += 1
        elif step is not None:
            where["python number"] += 1
    device_steps = sorted(k for k in where if k not in ("cpu", "meta", "python number"))
    if device_steps and not any(step_on_param_device(g) for g in groups):
        warnings.append(
            f"optimizer 'step' tensors are on {', '.join(device_steps)} though no group is fused or "
            "capturable: torch keeps them on the CPU (an accelerator step forces a host sync per parameter "
            "per step); dist_resume.optimizer_to() puts them back"
        )
    _shape_warnings(state, ids, names, model, warnings)
    if names and prefix_style(names) != prefix_style(model):
        warnings.append(f"optimizer param_names use prefix {prefix_style(names)!r}, model keys {prefix_style(model)!r}")
    summary = summarize_tensors(opt, storage_of)
    saved_kind = meta.get("optimizer_class")
    return {
        "kind": saved_kind or optimizer_kind(groups),
        "kind_from": "saved" if saved_kind else ("hyperparameters" if optimizer_kind(groups) else None),
        "param_groups": len(groups),
        "params": len(ids),
        "params_with_state": len(state),
        "state_keys": sorted(keys),
        "step": {"count": sum(where.values()), "where": dict(where), "dtypes": dict(step_dtypes)},
        "param_names": {"present": bool(names), "prefix_style": prefix_style(names) if names else None},
        "hyperparameters": {k: jsonable(v) for k, v in groups[0].items() if k not in NOT_HYPERPARAMETERS}
        if groups
        else {},
        "groups": [{k: jsonable(v) for k, v in g.items() if k not in GROUP_BOOKKEEPING} for g in groups],
        "tensors": summary["count"],
        "bytes": summary["bytes"],
    }


def _state_key_warning(opt: Mapping[str, Any], warnings: list[str]) -> None:
    """Say what resume does with state keys that name no id of the groups (FACTS 21: ``dcp_to_torch_save``).

    Mirrors :func:`~dist_resume._state.optim.prepare.prepare_optimizer_state`: digit strings are read as ids
    when every state key is one and each names an id of the groups; otherwise the entries are refused.
    """
    ids = [p for g in opt["param_groups"] for p in g["params"]]
    normalized = normalize_optimizer_state(opt)
    try:
        check_state_keys(normalized, "inspect")
    except OptimizerStateMismatchError:
        bad = unfit_state_keys(normalized) or [k for k in normalized["state"] if k not in set(ids)]
        digits = any(isinstance(k, str) and k.isdigit() for k in bad)
        warnings.append(
            f"{len(bad)} optimizer state {'entry fits' if len(bad) == 1 else 'entries fit'} no parameter of the "
            f"saved param_groups: {preview(bad)} (the groups list {preview(ids)}); resume refuses this optimizer "
            "state with OptimizerStateMismatchError"
            + (
                " (digit-string keys are read as ids only when every key is one and each names a group id)"
                if digits
                else ""
            )
            + ", where plain Optimizer.load_state_dict would keep the entries where no step reads them; key 'state' "
            "by the ids in 'param_groups', or resume without the optimizer"
        )
        return
    digit_keys = [k for k in opt["state"] if isinstance(k, str) and k.isdigit()]
    if digit_keys and normalized is not opt:
        warnings.append(
            f"optimizer state is keyed by digit strings ({preview(digit_keys, 3)}) while param_groups list int "
            "ids (what torch's dcp_to_torch_save writes): plain Optimizer.load_state_dict would silently leave "
            "every parameter without state; dist_resume's resume reads each digit string as the id it names "
            "(unambiguous here: every key is one and each names a group id)"
        )


def _shape_warnings(
    state: Mapping[Any, Any], ids: list[Any], names: list[str], model: Mapping[str, Any], warnings: list[str]
) -> None:
    shapes = {canonical_key(k): tuple(v.shape) for k, v in model.items() if isinstance(v, torch.Tensor)}
    all_shapes = set(shapes.values())
    by_id = dict(zip(ids, names)) if len(names) == len(ids) else {}
    problems = []
    for pid, per_param in state.items():
        if not isinstance(per_param, Mapping):
            continue
        name = by_id.get(pid)
        want = shapes.get(canonical_key(name)) if name else None
        for key, value in per_param.items():
            if not isinstance(value, torch.Tensor) or key == "step" or value.dim() == 0 or key in FACTORED_KEYS:
                continue
            shape = tuple(value.shape)
            if want is not None and shape != want:
                problems.append(f"state[{name!r}][{key!r}] is {shape}, the parameter {want}")
            elif want is None and shape not in all_shapes:
                problems.append(f"state[{name or pid!r}][{key!r}] is {shape}, which no model tensor has")
    if problems:
        warnings.append(
            "optimizer state does not fit the model's parameters: "
            + preview(problems, 3, sep="; ", quote=False)
            + " (it would be paired with the wrong parameters or fail at the first step)"
        )
