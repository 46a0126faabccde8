"""Restore as a plan: validate every part of a checkpoint against the live objects, then apply it all at once."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import torch

from ..._core.errors import OptimizerStateMismatchError, StateMismatchError
from ..._core.rank import global_rank
from ..._core.text import article, preview
from ..._core.tree import map_tensors, named_tensors
from ..._core.untrusted import untrusted
from ..._exact.data import check_data_state
from ..._layout.layout import CheckpointParts
from ..._state.optim.keys import optimizer_form_problem
from ..._state.optim.per_class import check_optimizer_state
from ..._state.optim.prepare import param_names, prepare_optimizer_state
from ..._state.subtree import select_prefix
from ..._state.validate import check_rng_states, check_scaler, check_scheduler
from ..apply.step import Step
from ..apply.steps import late_tensors, steps_of
from ..apply.transaction import Agree, Transfer, apply_plan, copy_pairs
from ..objects import LiveObjects
from ..options import OptimizerHparams, ResumeOptions
from .ema import adapt_ema_state
from .hparams import (
    check_hyperparameters,
    choose_hparams,
    hyperparameter_problem,
    lr_differs,
    optimizer_applied,
    strip_name_prefix,
)
from .model_fit import plan_model

__all__ = ["RestorePlan", "plan_restore", "check_has_data"]


@dataclass(frozen=True)
class RestorePlan:
    """What :func:`plan_restore` validated and :meth:`apply` will restore; nothing has changed yet.

    ``model_state`` is the checkpoint's model state re-keyed to ``model.state_dict()``'s form (``ema_state``
    likewise for ``ema``); ``optimizer_state`` the saved optimizer state paired with the live optimizer's
    parameters, its group hyperparameters already chosen by ``optimizer_hparams`` (None when the optimizer is
    not restored). ``restore`` and ``skipped`` name the parts, in the order :func:`resume` reports them;
    ``applied`` says how much of each part apply will restore (see :class:`ResumeResult`); ``notices`` are
    the ``(level, message)`` lines apply logs once it succeeded.
    """

    parts: CheckpointParts
    model_state: OrderedDict[str, Any]
    optimizer_state: dict[str, Any] | None
    restore: tuple[str, ...]
    skipped: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    objects: LiveObjects = field(repr=False)
    strict: bool
    mmapped: bool
    source: str
    ema_state: OrderedDict[str, Any] | None = None
    applied: dict[str, tuple[int, int]] = field(default_factory=dict)
    notices: tuple[tuple[int, str], ...] = ()

    def steps(self) -> list[Step]:
        """The steps :meth:`apply` runs before the commit, in order (see :mod:`~dist_resume._checkpoint.apply.steps`). Local."""
        return steps_of(self)

    def apply(self, *, agree: Agree | None = None, transfer: Transfer = copy_pairs) -> tuple[str, ...]:
        """Change the live objects, all or nothing; return the names of the parts restored (``self.restore``).

        Local (collective with ``agree``, see :func:`~dist_resume._checkpoint.apply.transaction.apply_plan`). A failure in any
        part's own load puts back every part already changed and raises :class:`~dist_resume.errors.RestoreError`
        naming the part; then the data is written in place (``transfer``), no copy kept. Optimizer state ends on its
        parameters' devices, in its existing tensors where they fit. Then the plan's notices are logged.
        """
        return apply_plan(self, agree=agree, transfer=transfer)

    def late_tensors(self) -> list[torch.Tensor]:
        """The checkpoint tensors whose data :meth:`apply` needs only at its commit (see
        :func:`~dist_resume._checkpoint.apply.steps.late_tensors`): a broadcast sends the others first. Local."""
        return late_tensors(self)

    def rebind(self, arrived: Mapping[int, torch.Tensor]) -> RestorePlan:
        """This plan with each tensor ``t`` replaced by ``arrived[id(t)]`` where given. Local; validates nothing.

        Under broadcast loading the plan is built on stand-ins before the data moves; this points it at
        the tensors the data arrived in.
        """

        def swap(obj: Any) -> Any:
            return map_tensors(obj, lambda t: arrived.get(id(t), t))

        fields = {f.name for f in dataclasses.fields(self.parts)} - {"layout", "step", "epoch"}
        parts = dataclasses.replace(self.parts, **{f: swap(getattr(self.parts, f)) for f in fields})
        return dataclasses.replace(
            self,
            parts=parts,
            model_state=swap(self.model_state),
            optimizer_state=swap(self.optimizer_state),
            ema_state=swap(self.ema_state),
        )


def plan_restore(
    parts: CheckpointParts,
    objects: LiveObjects,
    options: ResumeOptions,
    *,
    source: str = "checkpoint",
    mmapped: bool = False,
) -> RestorePlan:
    """Validate every part of ``parts`` against the live objects and say what :meth:`RestorePlan.apply` will do.

    Local; changes nothing. Checks model keys, shapes and dtypes, the optimizer's class, groups, parameter
    names and state shapes, the LR scheduler's and GradScaler's state, the sampler position, this rank's
    RNG entry and the EMA. A part the checkpoint lacks is skipped when ``options.allow_missing`` names it (or
    under ``strict=False``, with a warning), else it raises; absent RNG state is skipped (see
    :class:`ResumeOptions`). ``options.key_prefix`` selects the model sub-tree under it;
    ``options.optimizer_hparams`` chooses whose group hyperparameters the optimizer keeps. ``mmapped`` says
    that the checkpoint's tensors map its file: apply then clones the optimizer state that would alias it.
    """
    model, optimizer, scheduler, key_prefix = objects.model, objects.optimizer, objects.scheduler, options.key_prefix
    strict, hparams = options.strict, OptimizerHparams(options.optimizer_hparams)
    notices: list[tuple[int, str]] = []
    # every check of a saved part runs inside the boundary (_core/untrusted.py): one that fails on a value it did not
    # foresee is CheckpointCorruptError naming the part, never a raw error
    with untrusted(source, "its model state"):
        saved_model = parts.model if key_prefix is None else select_prefix(parts.model, key_prefix, source)
        model_state, missing, unexpected = plan_model(saved_model, model, strict, key_prefix is None, source)
    applied = {"model": (len(model_state), len(model.state_dict()))}

    def present(entry: Any, what: str, why: str = "to resume without it") -> bool:
        return _present(parts, entry, what, options, notices, source, why)

    optimizer_state = None
    if optimizer is not None and present(parts.optimizer, "optimizer"):
        saved_class = parts.meta.get("optimizer_class")
        if saved_class and str(saved_class) != type(optimizer).__name__:
            raise OptimizerStateMismatchError(
                f"{source}: the optimizer state was saved from {saved_class}, this optimizer is "
                f"{type(optimizer).__name__}; build {article(str(saved_class))}, or pass allow_missing=('optimizer',) "
                "and no optimizer"
            )
        with untrusted(source, "its optimizer state"):
            _check_optimizer_form(parts.optimizer, optimizer, source)
            saved_opt = parts.optimizer if key_prefix is None else strip_name_prefix(parts.optimizer, key_prefix)
            optimizer_state = prepare_optimizer_state(saved_opt, optimizer, model, source=source, strict=strict)
            scheduled = scheduler is not None and parts.scheduler is not None
            optimizer_state, applied["optimizer"] = choose_hparams(
                optimizer_state, optimizer, hparams, notices, scheduled
            )
            check_hyperparameters(optimizer_state["param_groups"], optimizer, source)
            check_optimizer_state(optimizer_state, optimizer, param_names(model), source=source)
    has_scheduler = scheduler is not None and present(parts.scheduler, "scheduler")
    if has_scheduler:
        with untrusted(source, "its scheduler state"):
            check_scheduler(parts.scheduler, scheduler, source)
    has_scaler = objects.scaler is not None and present(parts.scaler, "scaler")
    # a disabled scaler's {}: keep the fresh state (any other entry goes to check_scaler, which says what it is)
    empty_scaler = has_scaler and isinstance(parts.scaler, Mapping) and not parts.scaler and not strict
    if has_scaler and not empty_scaler:
        with untrusted(source, "its GradScaler state"):
            check_scaler(parts.scaler, objects.scaler, source)
    has_sampler = objects.data is not None and present(parts.sampler, "sampler", "to start the epoch afresh")
    if has_sampler:
        with untrusted(source, "its data position"):
            check_data_state(objects.data, parts.sampler, source)
    elif objects.data is None and parts.sampler is not None:
        notices.append((logging.WARNING, _NO_SAMPLER.format(source=source)))
    has_rng = options.rng and parts.rng is not None
    if has_rng:
        with untrusted(source, "its RNG states"):
            check_rng_states(parts.rng, global_rank(), source)
    elif options.rng:
        notices.append((logging.INFO, _NO_RNG.format(source=source, layout=parts.layout.value)))
    ema_state = None
    if objects.ema is not None and present(parts.ema, "ema"):
        with untrusted(source, "its EMA state"):
            ema_state = adapt_ema_state(parts.ema, objects.ema, strict=strict, source=source)
        applied["ema"] = (len(ema_state), len(objects.ema.state_dict()))
    kept_lr = optimizer_state is not None and hparams is OptimizerHparams.CURRENT and parts.optimizer is not None
    with untrusted(source, "its optimizer state"):
        lr_moved = kept_lr and has_scheduler and lr_differs(parts.optimizer["param_groups"], optimizer.param_groups)  # type: ignore[union-attr]
    if lr_moved:
        notices.append((logging.WARNING, _SCHEDULER_OVERRIDES.format(source=source)))
    done = {
        "model": applied["model"][0] > 0,
        "ema": ema_state is not None and applied["ema"][0] > 0,
        "scaler": has_scaler and not empty_scaler and objects.scaler.is_enabled(),  # a disabled one ignores any state
        "optimizer": optimizer_state is not None and optimizer_applied(optimizer_state, applied["optimizer"]),
        "scheduler": has_scheduler,
        "sampler": has_sampler,
        "rng": has_rng,
    }
    skipped = [name for name in objects.passed() if not done[name]]
    if options.rng and not done["rng"]:
        skipped.append("rng")
    return RestorePlan(
        parts=parts,
        model_state=model_state,
        optimizer_state=optimizer_state,
        restore=tuple(name for name, yes in done.items() if yes),
        skipped=tuple(skipped),
        missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected),
        objects=objects,
        strict=strict,
        mmapped=mmapped,
        source=source,
        ema_state=ema_state,
        applied=applied,
        notices=tuple(notices),
    )


_NO_SAMPLER: Final = (
    "{source} holds sampler state but no sampler was passed: the epoch restarts from its first batch; "
    "pass dataloader=... (a DataLoader over a ResumableDistributedSampler, or the sampler) to continue where it "
    "stopped"
)
_NOT_PASSED: Final = {"sampler": "pass no dataloader= (nor sampler=)"}
_NO_RNG: Final = (
    "{source} ({layout} layout) holds no RNG state: the RNG streams are left as they are (rng=False says not to "
    "look for them)"
)
_SCHEDULER_OVERRIDES: Final = (
    "{source}: optimizer_hparams='current' kept this optimizer's lr, which differs from the checkpoint's, but the "
    "restored LR scheduler recomputes lr at its next step() from its own saved state (base_lrs, last_epoch), so "
    "the kept lr may not last; to schedule from the new lr, pass no scheduler (allow_missing=('scheduler',)) and "
    "build a fresh one"
)


_SMALL_STATES: Final = ("scheduler", "scaler", "sampler", "rng")  # restored as they are, not through the model's keys


def check_has_data(plan: RestorePlan) -> None:
    """Raise :class:`StateMismatchError` naming the tensors :meth:`RestorePlan.apply` would copy from that have no data.

    Local. For a plan built on a checkpoint read with its data (a file read on this rank, rank 0's under a broadcast;
    not the other ranks' stand-ins, nor a read by ranges): a meta tensor there is the file's own, saved from a model on
    the meta device or edited in, and copying from it would fail half-way through the commit.
    """
    states = {"model": plan.model_state, "optimizer": plan.optimizer_state, "ema": plan.ema_state}
    states |= {part: getattr(plan.parts, part) for part in _SMALL_STATES if part in plan.restore}
    empty = [path for part, state in states.items() for path, tensor in named_tensors(state, part) if tensor.is_meta]
    if empty:
        raise StateMismatchError(
            f"{plan.source} holds meta tensors, without data, where it restores values "
            f"({preview(empty, quote=False, count=True)}): it was saved from a model on the meta device, or was damaged "
            "or edited; nothing was restored: resume from another checkpoint"
        )


def _check_optimizer_form(osd: Any, optimizer: torch.optim.Optimizer, source: str) -> None:
    """Refuse optimizer state not shaped as ``Optimizer.state_dict()`` makes it (hyperparameters the live groups hold
    as numbers or flags must be so there too), before anything looks inside."""
    problem = optimizer_form_problem(osd) or hyperparameter_problem(osd["param_groups"], optimizer.param_groups)
    if problem is None:
        return
    raise OptimizerStateMismatchError(
        f"{source}: the optimizer state {problem}; it was not written by Optimizer.state_dict() (or was damaged): "
        "resume from another checkpoint, or pass allow_missing=('optimizer',) and no optimizer"
    )


def _present(
    parts: CheckpointParts,
    entry: Any,
    what: str,
    options: ResumeOptions,
    notices: list[tuple[int, str]],
    source: str,
    why: str,
) -> bool:
    """Whether the checkpoint holds ``what``'s state; when it does not, skip it if allowed, else raise under
    ``strict`` (``strict=False`` skips it too, with a warning)."""
    if entry is not None:
        return True
    if what in options.allow_missing:
        return False
    if options.strict:
        raise StateMismatchError(
            f"{source} ({parts.layout.value} layout) has no {what} state but {article(what)} was passed; "
            f"pass allow_missing=({what!r},) {why}, or {_NOT_PASSED.get(what, f'do not pass the {what}')}"
        )
    notices.append(
        (
            logging.WARNING,
            f"{source} has no {what} state: strict=False skipped the {what}; allow_missing=({what!r},) says "
            "precisely which parts may be missing and keeps the model keys strict",
        )
    )
    return False
