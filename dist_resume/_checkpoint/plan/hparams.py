"""The optimizer part of a restore: whose group hyperparameters win, what differs, how much state applies."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import torch

from ..._core.errors import OptimizerStateMismatchError
from ..._core.text import preview, shown
from ..._state.optim.keys import GROUP_BOOKKEEPING, NOT_HYPERPARAMETERS
from ..._state.validate import is_number
from ..options import OptimizerHparams

__all__ = [
    "hparam_changes",
    "hyperparameter_problem",
    "required_hyperparameters",
    "check_hyperparameters",
    "lr_differs",
    "choose_hparams",
    "optimizer_applied",
    "strip_name_prefix",
]


def hparam_changes(saved_groups: Iterable[Mapping[str, Any]], live_groups: Iterable[Mapping[str, Any]]) -> list[str]:
    """``"group I NAME: checkpoint X, this optimizer Y"`` for each group hyperparameter that differs."""
    out = []
    for i, (saved, live) in enumerate(zip(saved_groups, live_groups)):
        for name in sorted((set(saved) | set(live)) - GROUP_BOOKKEEPING, key=str):  # (a damaged file's keys: any)
            old, new = saved.get(name, "absent"), live.get(name, "absent")
            if not _same(old, new):
                out.append(f"group {i} {name}: checkpoint {shown(old)}, this optimizer {shown(new)}")
    return out


def hyperparameter_problem(
    saved_groups: Iterable[Mapping[str, Any]], live_groups: Iterable[Mapping[str, Any]]
) -> str | None:
    """What the saved groups hold, as ``"has ..."``, where the live groups hold a number, a flag or a tuple of numbers
    (``betas``) and the file something else; or None. ``Optimizer.load_state_dict`` would take them as they are, and
    the checks of the optimizer state (``amsgrad``, ``momentum``) or its first ``step()`` trip on them."""
    odd = [
        f"group {i} {k}={shown(saved[k])}"
        for i, (saved, live) in enumerate(zip(saved_groups, live_groups))
        for k, v in live.items()
        if k in saved and not _same_kind(v, saved[k])
    ]
    return f"has hyperparameters of another kind than this optimizer's ({', '.join(odd[:3])})" if odd else None


# torch's optimizers' own __setstate__, as torch defines them: what their load_state_dict runs on the loaded groups. Taken
# once, at import: the dry run below runs torch's code, never a wrapper put on a class later (a profiler's, a test's)
_TORCH_SETSTATE: Final = {
    cls: vars(cls)["__setstate__"]
    for cls in vars(torch.optim).values()
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and "__setstate__" in vars(cls)
}


def _torch_setstate(cls: type) -> Callable[[Any, dict[str, Any]], None] | None:
    """The ``__setstate__`` torch wrote that ``cls``'s load runs, or None when a class of the user's overrides it."""
    for base in cls.__mro__:
        if base in _TORCH_SETSTATE:
            return _TORCH_SETSTATE[base]  # type: ignore[no-any-return]
        if "__setstate__" in vars(base) and not base.__module__.startswith("torch.optim"):
            return None
    return None


def required_hyperparameters(optimizer: torch.optim.Optimizer) -> frozenset[str]:
    """The group hyperparameters ``optimizer``'s ``step`` reads that its ``load_state_dict`` does not fill in. Local.

    Derived from the live optimizer, not from a table: its ``defaults`` (every key ``add_param_group`` gives each
    group, hence what its class's ``step`` reads) less what torch's ``__setstate__`` of its class sets on a loaded
    group that lacks it (torch's classes add their later options so: SGD's ``nesterov``, ``maximize``,
    ``foreach``; Adam's ``decoupled_weight_decay``, so that older files load). That ``__setstate__`` runs on a
    throwaway object holding one empty group; a class whose own ``__setstate__`` replaces torch's fills nothing here
    (its own code is not run to check a file).

    Example::

        >>> sorted(required_hyperparameters(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)))
        ['dampening', 'lr', 'momentum', 'weight_decay']
    """
    group: dict[str, Any] = {"params": []}
    setstate = _torch_setstate(type(optimizer))
    shadow = object.__new__(type(optimizer))
    shadow.__dict__.update({k: v for k, v in vars(optimizer).items() if k not in ("state", "param_groups")})
    shadow.defaults = dict(optimizer.defaults)
    try:
        if setstate is not None:
            setstate(shadow, {"state": {}, "param_groups": [group]})
    except Exception:  # torch's code on a throwaway: what it set before it raised still counts
        pass
    return frozenset(k for k in optimizer.defaults if isinstance(k, str) and k not in group) - NOT_HYPERPARAMETERS


def check_hyperparameters(groups: Iterable[Mapping[str, Any]], optimizer: torch.optim.Optimizer, source: str) -> None:
    """Raise :class:`OptimizerStateMismatchError` naming the group and the key when one of ``groups`` (what the
    optimizer's groups will be after the load) lacks a hyperparameter its ``step`` reads
    (:func:`required_hyperparameters`): the load would take it, and the first ``step()`` raise ``KeyError``. Local."""
    required = required_hyperparameters(optimizer)
    lacking = [
        f"group {i} lacks {preview(sorted(missing))}" for i, g in enumerate(groups) if (missing := required - set(g))
    ]
    if lacking:
        raise OptimizerStateMismatchError(
            f"{source}: the optimizer state {preview(lacking, 3, sep='; ', quote=False)}, which "
            f"{type(optimizer).__name__}.step() reads and its load does not fill in, so the first optimizer.step() "
            "would fail; the checkpoint is damaged or was edited, or was saved by another version of this optimizer "
            "class. Nothing was restored: resume with optimizer_hparams='current' to keep this optimizer's "
            "hyperparameters, from another checkpoint, or without the optimizer (allow_missing=('optimizer',))"
        )


def _same_kind(live: Any, saved: Any) -> bool:
    if isinstance(live, bool):  # None too: foreach and fused as torch saves them when left to it, tested for truth
        return saved is None or isinstance(saved, bool)
    if is_number(live):
        return is_number(saved)
    if isinstance(live, tuple) and all(map(is_number, live)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(live) and all(map(is_number, saved))
    if live is None:  # foreach, fused (torch decides; load_state_dict tests their truth), Adafactor's eps1
        return saved is None or isinstance(saved, bool) or is_number(saved)
    return True  # strings, the rest: as torch takes them


def lr_differs(saved_groups: Iterable[Mapping[str, Any]], live_groups: Iterable[Mapping[str, Any]]) -> bool:
    """Whether some group's ``lr`` differs between the checkpoint and the live optimizer."""
    return any(not _same(s.get("lr"), g.get("lr")) for s, g in zip(saved_groups, live_groups))


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # tensors (capturable lr), mismatched types: compare their text
        return repr(a) == repr(b)


def strip_name_prefix(saved_optimizer: Any, key_prefix: str) -> Any:
    """``saved_optimizer`` with ``key_prefix`` removed from its groups' ``param_names`` where present.
    A shallow copy (state tensors shared); anything not an optimizer state dict is returned as it is."""
    if not isinstance(saved_optimizer, Mapping) or not isinstance(saved_optimizer.get("param_groups"), (list, tuple)):
        return saved_optimizer
    groups = []
    for group in saved_optimizer["param_groups"]:
        names = group.get("param_names") if isinstance(group, Mapping) else None
        if names is not None:
            group = {
                **group,
                "param_names": [n[len(key_prefix) :] if n.startswith(key_prefix) else n for n in names],
            }
        groups.append(group)
    return {**saved_optimizer, "param_groups": groups}


def choose_hparams(
    opt_sd: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    hparams: OptimizerHparams,
    notices: list[tuple[int, str]],
    scheduled: bool = False,
) -> tuple[dict[str, Any], tuple[int, int]]:
    """``opt_sd`` with the group hyperparameters ``hparams`` chooses (logging each that differs) and
    ``(parameters with saved state, parameters)``. ``scheduled``: an LR scheduler is restored too, so
    a differing ``lr`` is most likely its doing (a warm-up sets it when the scheduler is built), and
    the line says so."""
    changes = hparam_changes(opt_sd["param_groups"], optimizer.param_groups)
    if changes:
        whose = "the checkpoint's values replace" if hparams is OptimizerHparams.CHECKPOINT else "keeping"
        why = " (an LR scheduler sets it; the scheduler is restored too)"
        for c in changes:
            by_scheduler = scheduled and c.split()[2] in ("lr:", "initial_lr:")
            # the default on an ordinary resume: the scheduler's lr coming back is no news (DEBUG)
            level = logging.DEBUG if by_scheduler and hparams is OptimizerHparams.CHECKPOINT else logging.INFO
            notices.append(
                (
                    level,
                    f"optimizer_hparams={hparams.value!r}: {whose} this optimizer's: {c}"
                    + (why if by_scheduler else ""),
                )
            )
    if hparams is OptimizerHparams.CURRENT:
        groups = []
        for live, saved in zip(optimizer.param_groups, opt_sd["param_groups"]):
            group = {k: v for k, v in live.items() if k not in ("params", "param_names")}
            group.update({k: saved[k] for k in ("params", "param_names") if k in saved})
            groups.append(group)
        opt_sd = {**opt_sd, "param_groups": groups}
    ids = [i for group in opt_sd["param_groups"] for i in group["params"]]
    return opt_sd, (sum(1 for i in ids if opt_sd["state"].get(i)), len(ids))


def optimizer_applied(opt_sd: dict[str, Any], counts: tuple[int, int]) -> bool:
    """Restored when some parameter gets state, or when the file holds none at all (a stateless optimizer
    such as SGD without momentum, or one saved before its first step: its hyperparameters are what it has)."""
    return counts[0] > 0 or not opt_sd["state"]
