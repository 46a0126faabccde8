"""Per-class optimizer state: each saved per-parameter entry has the keys, shapes and dtypes its optimizer's step needs.

``Optimizer.load_state_dict`` checks group sizes only (FACTS 1): an entry that lacks a key, or holds
a tensor of another shape, loads and fails at the first ``step()`` (or in ``__setstate__``, after
part of the state was applied: a ``step`` renamed ``Dtep`` raised a bare ``KeyError: 'step'``), and
a tensor of another dtype kind is cast silently (an integer ``exp_avg`` becomes a float one with
its fractions gone). :func:`check_optimizer_state` refuses all of these before anything changes.

Why a table and not a dry run. A dry ``load_state_dict`` on a shadow optimizer runs only
``__setstate__``, which looks at ``step`` and nothing else; a dry ``step()`` over meta stand-ins
fails on valid states (``Tensor.item()`` on a meta ``step``, the fused and foreach paths refuse
meta tensors), and over CPU copies it doubles the state in memory and computes a real update.
torch's built-in optimizers create every key of an entry at once, the first time a parameter has a
gradient (Adagrad in ``__init__``), so a non-empty entry must hold exactly those keys: the table
below lists them per class and per the group's options, read from torch 2.13's ``_init_group``s
(``tests/test_optim_state.py`` checks it against what each class really writes).

Classes the table does not know (custom optimizers, and subclasses that override ``step``,
``_init_group`` or ``__setstate__``) get the generic check only: every entry is a dict, and the
shape check of :func:`~.match.check_state_shapes` (a tensor that looks per-element has the
parameter's shape); their dtypes are their own business (a bool mask per element is legitimate).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import torch

from ..._core.errors import OptimizerStateMismatchError
from ..._core.text import described, preview
from ..validate import is_number

__all__ = ["check_optimizer_state"]

_Group = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class _Spec:
    """What one class keeps per parameter: tensors shaped like it, and one-element numbers."""

    per_element: Callable[[_Group], frozenset[str]]
    scalars: frozenset[str]
    optional: frozenset[str] = frozenset()  # keys the class writes under other options only

    def known(self) -> frozenset[str]:
        return self.scalars | self.optional | self.per_element({})


def _keys(*names: str) -> Callable[[_Group], frozenset[str]]:
    fixed = frozenset(names)
    return lambda group: fixed


def _adam(group: _Group) -> frozenset[str]:
    return frozenset({"exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group.get("amsgrad") else set()))


def _rmsprop(group: _Group) -> frozenset[str]:
    keys = {"square_avg"}
    if group.get("momentum", 0) > 0:
        keys.add("momentum_buffer")
    if group.get("centered"):
        keys.add("grad_avg")
    return frozenset(keys)


def _sgd(group: _Group) -> frozenset[str]:
    return frozenset({"momentum_buffer"} if group.get("momentum", 0) != 0 else set())


_STEP: Final = frozenset({"step"})
_SPECS: Final[dict[type[torch.optim.Optimizer], _Spec]] = {
    torch.optim.SGD: _Spec(_sgd, frozenset(), frozenset({"momentum_buffer"})),
    torch.optim.Adam: _Spec(_adam, _STEP, frozenset({"max_exp_avg_sq"})),
    torch.optim.AdamW: _Spec(_adam, _STEP, frozenset({"max_exp_avg_sq"})),
    torch.optim.Adagrad: _Spec(_keys("sum"), _STEP),
    torch.optim.RMSprop: _Spec(_rmsprop, _STEP, frozenset({"momentum_buffer", "grad_avg"})),
    torch.optim.Adamax: _Spec(_keys("exp_avg", "exp_inf"), _STEP),
    torch.optim.NAdam: _Spec(_keys("exp_avg", "exp_avg_sq"), _STEP | {"mu_product"}),
    torch.optim.RAdam: _Spec(_keys("exp_avg", "exp_avg_sq"), _STEP),
    torch.optim.ASGD: _Spec(_keys("ax"), _STEP | {"eta", "mu"}),
    torch.optim.Rprop: _Spec(_keys("prev", "step_size"), _STEP),
    torch.optim.Adadelta: _Spec(_keys("square_avg", "acc_delta"), _STEP),
    torch.optim.SparseAdam: _Spec(_keys("exp_avg", "exp_avg_sq"), _STEP),
}
_OWN_BEHAVIOUR: Final = ("step", "_init_group", "__setstate__")
# LBFGS keeps one flat state under its first parameter: counters always, the rest once an iteration ran
_LBFGS_COUNTERS: Final = ("func_evals", "n_iter")
_LBFGS_AFTER_ITERATION: Final = ("d", "t", "old_dirs", "old_stps", "ro", "H_diag", "prev_flat_grad", "prev_loss")
_LBFGS_FLAT: Final = ("d", "prev_flat_grad")
_NOT_FIRST: Final = "holds state, but LBFGS keeps all of its state under its first parameter"
_LBFGS_KNOWN: Final = frozenset({*_LBFGS_COUNTERS, *_LBFGS_AFTER_ITERATION, "al"})


def _table_class(optimizer: torch.optim.Optimizer) -> type[torch.optim.Optimizer] | None:
    """The built-in class whose table applies: the optimizer's own, or a base its subclass does not override."""
    cls = type(optimizer)
    for base in cls.__mro__:
        if base in _SPECS or base is torch.optim.LBFGS:
            # torch wraps ``step`` in its hooks (functools.wraps): compare what is underneath
            own = [m for m in _OWN_BEHAVIOUR if hasattr(base, m)]
            same = all(inspect.unwrap(getattr(cls, m)) is inspect.unwrap(getattr(base, m)) for m in own)
            return base if same else None
    return None


def _kind(dtype: torch.dtype) -> str:
    return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else str(dtype).split(".")[-1]


def _number_problem(value: Any, floating: bool, counter: bool = False) -> str | None:
    """Why ``value`` is not a one-element real finite number (a Python number or a one-element tensor), or None;
    a ``counter`` (``step``, LBFGS's ``n_iter``) not negative either.
    torch's load turns a Python ``step`` into a float tensor: an int past 1e308 would raise there, half-way through
    the optimizer's load, a NaN or infinite counter would turn every later update into NaN, and a negative ``step``
    fails the first ``step()`` (AdamW's bias correction takes the square root of ``1 - beta2 ** step``)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            return f"a tensor of shape {tuple(value.shape)}, where one number belongs"
        if value.dtype.is_complex or value.dtype == torch.bool or (floating and not value.dtype.is_floating_point):
            return f"a {value.dtype} tensor, where a real{' floating' if floating else ''} number belongs"
        if value.is_meta:  # a stand-in's value is checked where it is
            return None
        if not bool(torch.isfinite(value).all()):
            return f"a tensor holding {value.item()}, where a finite number belongs"
        if counter and bool((value < 0).any()):
            return f"a tensor holding {value.item()}, where a count from 0 belongs"
        return None
    if not is_number(value):  # not a number, or an int past int64
        return f"{type(value).__name__} {described(value, 40)}, where a number belongs"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value}, where a finite number belongs"
    if counter and value < 0:
        return f"{value}, where a count from 0 belongs"
    return None


def _tensor_problem(value: Any, param: torch.Tensor, shape: torch.Size | None = None) -> str | None:
    """Why ``value`` is not a tensor of ``shape`` (default: the parameter's) and of the parameter's dtype kind."""
    want = param.shape if shape is None else shape
    if not isinstance(value, torch.Tensor):
        return f"{type(value).__name__}, where a tensor of shape {tuple(want)} belongs"
    if value.shape != want:
        return f"shape {tuple(value.shape)}, expected {tuple(want)}"
    if (param.is_floating_point() or param.is_complex()) and _kind(value.dtype) != _kind(param.dtype):
        return f"dtype {value.dtype}, expected a {_kind(param.dtype)} dtype like the parameter's {param.dtype}"
    return None


def _entry_problems(entry: Mapping[Any, Any], param: torch.Tensor, group: _Group, spec: _Spec, kind: str) -> list[str]:
    per_element, scalars = spec.per_element(group), spec.scalars
    required = per_element | scalars
    missing = sorted(required - set(entry))
    unknown = sorted(described(k) for k in set(entry) - spec.known())  # a damaged file's keys: any type
    problems = []
    if missing or unknown:
        what = []
        if missing:
            what.append(f"lacks {preview(missing)} ({kind} keeps {preview(sorted(required))} here)")
        if unknown:
            what.append(f"has {preview(unknown, quote=False)}, which {kind} never writes")
        problems.append(" and ".join(what))
    for key, value in sorted(((k, v) for k, v in entry.items() if type(k) is str), key=lambda kv: kv[0]):
        if key in scalars:
            problem = _number_problem(value, floating=key != "step", counter=key == "step")
        elif key in per_element or key in spec.optional:
            allowed_none = kind == "SGD" and value is None  # torch's SGD starts such a buffer afresh
            problem = None if allowed_none else _tensor_problem(value, param)
        else:
            continue
        if problem:
            problems.append(f"{key!r} is {problem}")
    return problems


def _lbfgs_problems(entry: Mapping[Any, Any], numel: int, param: torch.Tensor) -> list[str]:
    problems = [f"lacks {k!r}" for k in _LBFGS_COUNTERS if k not in entry]
    problems += [
        f"{k!r} is {p}" for k in _LBFGS_COUNTERS if k in entry if (p := _number_problem(entry[k], False, counter=True))
    ]
    if not problems and entry["n_iter"] > 0:
        problems += [f"lacks {k!r} (kept once an iteration ran)" for k in _LBFGS_AFTER_ITERATION if k not in entry]
    unknown = sorted(described(k) for k in entry if k not in _LBFGS_KNOWN)
    if unknown:
        problems.append(f"has {preview(unknown, quote=False)}, which LBFGS never writes")
    flat = torch.Size([numel])
    for key in _LBFGS_FLAT:
        if entry.get(key) is not None and (p := _tensor_problem(entry[key], param, flat)):
            problems.append(f"{key!r} is {p} (one flat vector over all parameters)")
    for key in ("old_dirs", "old_stps"):
        history = entry.get(key)
        if history is None:
            continue
        if not isinstance(history, (list, tuple)):
            problems.append(f"{key!r} is {type(history).__name__}, where a list of flat tensors belongs")
            continue
        problems += [f"{key}[{i}] is {p}" for i, t in enumerate(history) if (p := _tensor_problem(t, param, flat))]
    return problems


def check_optimizer_state(
    prepared: Mapping[str, Any],
    optimizer: torch.optim.Optimizer,
    names: Mapping[int, str] | None = None,
    *,
    source: str = "checkpoint",
) -> None:
    """Raise :class:`OptimizerStateMismatchError` unless every entry of ``prepared`` fits its parameter's class.

    Local; changes nothing. ``prepared`` is a state dict whose groups list the saved ids in the
    order of ``optimizer``'s groups (what ``prepare_optimizer_state`` returns, hyper-parameters
    chosen), so entry ``sid`` belongs to the live parameter at the same place; the group's options
    (``amsgrad``, ``momentum``, ``centered``) are the ones the load will apply. ``names`` maps
    ``id(parameter)`` to its name for the message (the groups' ``param_names`` are used first).

    For torch's built-in classes every non-empty entry must hold exactly the keys the class writes
    (per its options), each per-element tensor the parameter's shape and dtype kind, and each
    number (``step``, ASGD's ``eta``/``mu``, NAdam's ``mu_product``) one real finite number, ``step`` not negative;
    LBFGS's flat
    state must sit under its first parameter, with vectors as long as all parameters together.
    Other classes: every entry must be a dict.

    Example::

        >>> model = torch.nn.Linear(2, 2)
        >>> opt = torch.optim.Adam(model.parameters())
        >>> model(torch.ones(1, 2)).sum().backward(); opt.step()
        >>> sd = opt.state_dict(); del sd["state"][0]["exp_avg"]
        >>> check_optimizer_state(sd, opt)
        Traceback (most recent call last):
        ...
        dist_resume.OptimizerStateMismatchError: checkpoint: ...lacks 'exp_avg' ...
    """
    table = _table_class(optimizer)
    kind = type(optimizer).__name__ if table is None else table.__name__
    names = names or {}
    problems: list[str] = []
    lbfgs = table is torch.optim.LBFGS
    numel = sum(p.numel() * (2 if p.is_complex() else 1) for g in optimizer.param_groups for p in g["params"])
    for gi, (sgroup, group) in enumerate(zip(prepared["param_groups"], optimizer.param_groups)):
        own = sgroup.get("param_names") or group.get("param_names")
        for i, (sid, param) in enumerate(zip(sgroup["params"], group["params"])):
            entry = prepared["state"].get(sid)
            if not entry:
                continue
            name = (own[i] if own and i < len(own) else None) or names.get(id(param)) or f"#{sid} (group {gi})"
            if not isinstance(entry, Mapping):
                found = [f"is {type(entry).__name__}, where a dict of state belongs"]
            elif lbfgs:
                first = gi == 0 and i == 0
                found = _lbfgs_problems(entry, numel, param) if first else [_NOT_FIRST]
            elif table is not None:
                found = _entry_problems(entry, param, sgroup, _SPECS[table], kind)
            else:
                found = []
            problems += [f"state[{name}]: {p}" for p in found]
    if problems:
        raise OptimizerStateMismatchError(
            f"{source}: the saved optimizer state does not fit {kind}: {preview(problems, sep='; ', quote=False)}; "
            "the checkpoint is damaged or its optimizer was another class or had other options. Nothing was "
            "restored: resume from another checkpoint, or without the optimizer (allow_missing=('optimizer',))"
        )
