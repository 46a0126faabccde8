"""Applying a validated :class:`~dist_resume._checkpoint.plan.restore_plan.RestorePlan`: what can fail first, then the ranks agree,
then the commit, which writes the data in place.

1. **The steps** (:mod:`.steps`, in the order of :data:`STEPS`): the small states (GradScaler, scheduler, data position,
   RNG streams), torch's ``Optimizer.load_state_dict`` on the optimizer's own state tensors (their data untouched),
   and the load of a module only where its own load can raise after validation (a load hook, an overridden
   ``_load_from_state_dict`` or ``set_extra_state``: there, a CPU copy of what it overwrites is kept). Each step saves
   what it changes; when one raises, every step already run is put back in reverse order and
   :class:`~dist_resume.errors.RestoreError` names the part.
2. **The ranks agree** (a collective resume): one rank's failure puts every rank back, and every rank raises it.
3. **The commit**: the saved data is written into the live tensors in place (the optimizer's state tensors, the
   model's and EMA's; under ``broadcast_from_rank0`` received straight into them), then those modules'
   ``load_state_dict`` runs on data already in place (it copies nothing more; it sets the non-tensor entries and
   extra state). No copy is kept: the plan validated everything these do, so only a fault in the copying itself can
   stop them (an I/O error on the file's pages, a device error, a peer lost mid-transfer). Such a fault raises
   :class:`~dist_resume.errors.PartialRestoreError`, on every rank after agreeing once more: the objects may hold part
   of the checkpoint, and resuming from it again restores it whole.

Held while apply runs: the small states' copies and the optimizer's old containers (no tensor data); new optimizer
state where the optimizer had none (the state it must create anyway); under a broadcast, one bucket.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Final

import torch

from ..._core.errors import DistResumeError, PartialRestoreError, RestoreError
from ..._core.log import log_rank0, logger
from .module_step import module_pairs
from .step import Pairs, RestorePlan, Step
from .steps import committed_modules, steps_of

__all__ = ["STEPS", "Stage", "Agree", "Transfer", "copy_pairs", "run_transaction", "apply_plan"]

STEPS: Final = ("scaler", "scheduler", "sampler", "rng", "optimizer", "model", "ema")
"""The parts apply restores, in the order it restores them (a committed model and EMA come last, at the commit)."""


class Stage(enum.Enum):
    """Where the ranks agree, and what a failure there means (the words every rank's error carries)."""

    STEPS = "could not apply the checkpoint, so every rank put back what it had changed"
    COMMIT = (
        "could not write the checkpoint's data into the live tensors after every rank had agreed to, so the model, "
        "EMA and optimizer may hold part of it on every rank; resume from it again to restore it whole"
    )


Agree = Callable[[BaseException | None, Stage], None]
"""Collective: every rank learns every rank's outcome at ``stage``; raises on the ranks that did not fail when one did."""
Transfer = Callable[[Pairs], Exception | None]
"""Write each saved tensor's data into its live destination; the first failure, or None (never raises)."""


def copy_pairs(pairs: Pairs) -> Exception | None:
    """The local :data:`Transfer`: ``dst.copy_(saved)`` for each pair. Local."""
    try:
        with torch.no_grad():
            for saved, dst in pairs:
                dst.copy_(saved)
    except Exception as err:  # the caller raises PartialRestoreError (after agreeing, when collective)
        return err
    return None


def run_transaction(
    plan: RestorePlan,
    steps: list[Step],
    commit: Callable[[Pairs], tuple[str, Exception | None]],
    *,
    agree: Agree | None = None,
) -> tuple[str, ...]:
    """Run ``steps`` (undoing them all and raising :class:`RestoreError` when one fails), agree, then ``commit`` the
    pairs the steps returned (it returns the part it was writing and its failure, never raises). Returns
    ``plan.restore``; logs the plan's notices once everything succeeded.

    Local, unless ``agree`` is given (collective): it is called on every rank after the steps and after the commit,
    and raises on the ranks that did not fail when another did.
    """
    done: list[tuple[Step, Any]] = []
    pairs: Pairs = []
    failure: tuple[Step, Exception, bool] | None = None  # the step, what it raised, whether in save()
    for step in steps:
        try:
            saved = step.save()
            done.append((step, saved))
            more = step.do()
        except Exception as err:
            failure = (step, err, not done or done[-1][0] is not step)
            break
        pairs += more or []
    error = None if failure is None else _failed(plan.source, *failure, not_undone=[])
    if agree is not None:
        try:
            agree(error, Stage.STEPS)  # the other ranks raise this rank's RestoreError, relayed
        except DistResumeError:
            _undo(done, plan.source)
            raise
    if failure is not None and error is not None:
        not_undone = _undo(done, plan.source)
        raise (_failed(plan.source, *failure, not_undone=not_undone) if not_undone else error) from failure[1]
    part, fault = commit(pairs)
    partial = None if fault is None else _partial(plan.source, part, fault)
    if agree is not None:
        agree(partial, Stage.COMMIT)
    if partial is not None:
        raise partial from fault
    for level, message in plan.notices:
        log_rank0(level, "%s", message)
    return plan.restore


def apply_plan(plan: RestorePlan, *, agree: Agree | None = None, transfer: Transfer = copy_pairs) -> tuple[str, ...]:
    """Apply ``plan`` into a plain, DDP or compiled model: the steps, the agreement, the commit (see the module).

    Local, unless ``agree`` is given (collective). ``transfer`` writes the data at the commit (:func:`copy_pairs`;
    a broadcast resume receives it instead). Returns ``plan.restore``.
    """
    modules = committed_modules(plan)

    def commit(pairs: Pairs) -> tuple[str, Exception | None]:
        pairs = pairs + [pair for _, module, state in modules for pair in module_pairs(module, state)]
        written = ", ".join(name for name in STEPS if name in ("optimizer", "model", "ema") and name in plan.restore)
        fault = transfer(pairs)
        if fault is not None:
            return written, fault
        into = {id(saved): dst for saved, dst in pairs}
        for name, module, state in modules:
            try:  # the data is in place already: this copies it onto itself (no-op) and sets the rest
                module.load_state_dict({k: into.get(id(v), v) for k, v in state.items()}, strict=plan.strict)
            except Exception as err:
                return name, err
        return written, None

    return run_transaction(plan, steps_of(plan), commit, agree=agree)


def _failed(source: str, step: Step, err: Exception, saving: bool, *, not_undone: list[str]) -> RestoreError:
    what = "saving the state to put back of" if saving else "restoring"
    if not_undone:
        state = f"putting back the {', '.join(not_undone)} failed too (logged): it may hold part of the checkpoint"
    else:
        state = "every object is as it was before the resume (the parts already restored were put back)"
    return RestoreError(
        f"{source}: {what} the {step.name} failed ({type(err).__name__}: {err}); {state}. The checkpoint passed "
        f"validation, so the cause is in the {step.name}'s own load (a hook, a device or sharding error, or state "
        "the validation does not cover): the chained exception says which",
        part=step.name,
    )


def _partial(source: str, part: str, err: Exception) -> PartialRestoreError:
    return PartialRestoreError(
        f"{source}: writing the checkpoint's data into the {part} failed ({type(err).__name__}: {err}) after every "
        f"other part was restored, so the {part} may hold part of the checkpoint; resume from it again to restore it "
        "whole (the checkpoint itself is untouched)",
        part=part,
    )


def _undo(done: list[tuple[Step, Any]], source: str) -> list[str]:
    """Undo ``done`` in reverse order; the names of the steps whose undo raised (each logged, the rest still run)."""
    failed = []
    for step, saved in reversed(done):
        try:
            step.undo(saved)
        except Exception:
            logger.exception(
                "%s: putting back the %s after a failed resume failed; it may hold part of it", source, step.name
            )
            failed.append(step.name)
    return failed
