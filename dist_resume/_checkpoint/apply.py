"""Applying a validated :class:`~dist_resume._checkpoint.plan.RestorePlan` as one transaction.

Apply is a list of named :class:`Step` s in the order of :data:`STEPS`: cheap to put back first (the small states,
then the optimizer, whose undo costs nothing), the model and EMA last. Each step ``save`` s what its ``do`` will
change; when one raises, every step already run is undone in reverse order and
:class:`~dist_resume.errors.RestoreError` names the part. Under a collective resume the ranks agree after the last
step: one rank's failure undoes every rank. Only then run the commits (the saved optimizer data copied into its
existing state tensors: same shape, dtype and device).

Held while apply runs: the small states; the optimizer's old ``state``/``param_groups`` containers (no tensor data:
torch's ``load_state_dict`` builds new ones); CPU copies of the model's (and EMA's) overwritten tensors, only where
something can fail after them (the EMA, the ranks' agreement) or their own load can (:func:`_can_raise`). A
broadcast that wrote into live tensors copied them first (:meth:`RestorePlan.destinations`): ``received`` undoes it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol

import torch
from torch import nn

from .._core.errors import DistResumeError, RestoreError
from .._core.log import log_rank0, logger
from .._exact import rng as _rng
from .._exact.sampler import ResumableDistributedSampler
from .._layout.layout import CheckpointParts
from .._state.optim import optimizer_to
from .inplace import detach_from_file, live_twins, storage_ptrs
from .objects import LiveObjects

__all__ = ["STEPS", "Step", "small_steps", "steps_of", "apply_plan", "apply_then_fill"]

STEPS: Final = ("scaler", "scheduler", "sampler", "rng", "optimizer", "model", "ema")
"""The parts apply restores, in the order it restores them (a broadcast resume's ``received`` step goes first)."""

Commit = Callable[[], None]
_EXTRA: Final = "_extra_state"  # the state_dict key of nn.Module.get_extra_state()


class RestorePlan(Protocol):
    """What apply reads of :class:`~dist_resume._checkpoint.plan.RestorePlan` (which imports this module)."""

    @property
    def parts(self) -> CheckpointParts: ...
    @property
    def objects(self) -> LiveObjects: ...
    @property
    def restore(self) -> tuple[str, ...]: ...
    @property
    def model_state(self) -> Any: ...
    @property
    def optimizer_state(self) -> dict[str, Any] | None: ...
    @property
    def ema_state(self) -> Any: ...
    @property
    def strict(self) -> bool: ...
    @property
    def mmapped(self) -> bool: ...
    @property
    def source(self) -> str: ...
    @property
    def notices(self) -> tuple[tuple[int, str], ...]: ...
    @property
    def landed(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]: ...


@dataclass(frozen=True)
class Step:
    """One part of apply: ``save()`` what ``do()`` changes, ``do()`` change it (returning a commit to run once every
    step, on every rank, succeeded, or None), ``undo(saved)`` put it back."""

    name: str
    save: Callable[[], Any]
    do: Callable[[], Commit | None]
    undo: Callable[[Any], None]


def _loaded(obj: Any, state: Any) -> Callable[[], None]:
    def do() -> None:
        obj.load_state_dict(state)

    return do


def _small(name: str, obj: Any, state: Any) -> Step:
    """A scheduler, GradScaler or data position: its own (small) state dict, copied, is what undo loads back."""
    if isinstance(obj, ResumableDistributedSampler):  # its attributes, so that a live iterator goes on as it was
        return Step(name, lambda: dict(vars(obj)), _loaded(obj, state), lambda saved: _set_vars(obj, saved))
    return Step(name, lambda: copy.deepcopy(obj.state_dict()), _loaded(obj, state), obj.load_state_dict)


def _set_vars(obj: Any, saved: dict[str, Any]) -> None:
    vars(obj).clear()
    vars(obj).update(saved)


def _rng_step(plan: RestorePlan) -> Step:
    device = _rng.param_device(plan.objects.model)

    def save() -> tuple[dict[str, Any], int | None]:
        return _rng.rng_state_dict(device), _rng._base_seed  # seed_rng (a new rank's streams) sets the base seed

    def do() -> None:
        _rng.restore_rank_rng(plan.parts.rng, step=plan.parts.step, device=device, source=plan.source)

    def undo(saved: tuple[dict[str, Any], int | None]) -> None:
        _rng.load_rng_state_dict(saved[0], device)
        _rng._base_seed = saved[1]

    return Step("rng", save, do, undo)


@dataclass(frozen=True)
class _OptimizerBefore:
    state: Any  # the optimizer's own containers: torch's load_state_dict replaces them, it never edits them
    groups: list[dict[str, Any]]
    group_items: list[dict[str, Any]]
    defaults: dict[str, Any]


def _optimizer_step(plan: RestorePlan) -> Step:
    """torch's ``load_state_dict`` given the optimizer's own state tensors (data unchanged) wherever the saved state
    fits them, and the saved tensors elsewhere; the saved data is copied into those tensors at commit."""
    opt, saved_sd = plan.objects.optimizer, plan.optimizer_state
    assert opt is not None and saved_sd is not None

    def save() -> _OptimizerBefore:
        groups = opt.param_groups
        return _OptimizerBefore(opt.state, groups, [dict(g) for g in groups], dict(opt.defaults))

    def do() -> Commit:
        twins = list(live_twins(opt, saved_sd))
        state = {sid: dict(entries) for sid, entries in saved_sd["state"].items()}
        for sid, key, _, twin in twins:
            state[sid][key] = twin
        opt.load_state_dict({**saved_sd, "state": state})
        optimizer_to(opt)
        saved_ids = (i for group in saved_sd["param_groups"] for i in group["params"])
        param_of = dict(zip(saved_ids, (p for group in opt.param_groups for p in group["params"])))
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []
        for sid, key, value, twin in twins:
            entries = opt.state[param_of[sid]]
            now = entries.get(key)
            if now is twin:
                if value is not twin:  # data a broadcast received into the twin is there already
                    pending.append((twin, value))
            elif isinstance(now, torch.Tensor):  # torch (or optimizer_to) placed it anew: place the saved data so
                entries[key] = value.to(device=now.device, dtype=now.dtype, copy=True)
        if plan.mmapped:
            detach_from_file(opt, storage_ptrs(plan.parts.optimizer))
        return lambda: _copy_into(pending)

    def undo(before: _OptimizerBefore) -> None:
        for group, items in zip(before.groups, before.group_items):
            group.clear()
            group.update(items)
        opt.defaults.clear()
        opt.defaults.update(before.defaults)
        vars(opt).update(state=before.state, param_groups=before.groups)

    return Step("optimizer", save, do, undo)


def _copy_into(pending: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for dst, src in pending:
            dst.copy_(src)


def _module_step(
    name: str, module: nn.Module, state: dict[str, Any], strict: bool, plan: RestorePlan, keep: bool
) -> Step:
    """``module.load_state_dict``; undo copies back a CPU copy of each tensor it overwrites, kept only when ``keep``
    (something after it can fail, or its own load can: see :func:`_can_raise`), and its modules' extra state."""

    def save() -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]] | None, dict[str, Any]]:
        live = module.state_dict(keep_vars=True)
        tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        extras: dict[str, Any] = {}
        for key in state:
            value = live.get(key)
            if isinstance(value, torch.Tensor):
                if keep and id(value) not in tensors and id(value) not in plan.landed:
                    tensors[id(value)] = (value, value.detach().to("cpu", copy=True))
            elif key.endswith(_EXTRA) and key in live:
                extras[key[: -len(_EXTRA)].rstrip(".")] = copy.deepcopy(value)
        return tensors if keep else None, extras

    def do() -> None:
        module.load_state_dict(state, strict=strict)

    def undo(saved: tuple[dict[int, tuple[torch.Tensor, torch.Tensor]] | None, dict[str, Any]]) -> None:
        tensors, extras = saved
        for path, extra in extras.items():
            module.get_submodule(path).set_extra_state(extra)
        if tensors is None:
            raise RuntimeError(f"no copy of the {name}'s tensors was kept: nothing in its load was expected to raise")
        _copy_into([(live.detach(), old) for live, old in tensors.values()])

    return Step(name, save, do, undo)


def _can_raise(module: nn.Module) -> bool:
    """Whether ``module``'s load can raise once the plan validated its keys, shapes and dtypes: a load hook, or a
    ``_load_from_state_dict`` / ``set_extra_state`` not torch.nn's own (FSDP2, quantized layers, an override)."""
    for m in module.modules():
        if m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks:
            return True
        for method in ("_load_from_state_dict", "set_extra_state"):
            if method in vars(m) or not getattr(type(m), method).__module__.startswith("torch.nn."):
                return True
    return False


def _received_step(landed: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Step:
    """What a broadcast received straight into live tensors (``{id: (live, copy before)}``), put back by undo."""
    return Step("received", lambda: None, lambda: None, lambda _: _copy_into(list(landed.values())))


def small_steps(plan: RestorePlan) -> list[Step]:
    """The steps of the small states ``plan.restore`` names: GradScaler, scheduler, data position, RNG. Local."""
    live, restore, steps = plan.objects, plan.restore, []
    if "scaler" in restore:
        steps.append(_small("scaler", live.scaler, plan.parts.scaler))
    if "scheduler" in restore:
        steps.append(_small("scheduler", live.scheduler, plan.parts.scheduler))
    if "sampler" in restore:
        steps.append(_small("sampler", live.data, plan.parts.sampler))
    if "rng" in restore:
        steps.append(_rng_step(plan))
    return steps


def apply_then_fill(plan: RestorePlan, fill: Callable[[], None]) -> tuple[str, ...]:
    """An FSDP2 model's apply: the small states as steps (a failure undoes them and raises :class:`RestoreError`),
    then ``fill()`` (model, EMA and optimizer shards written in place, no copy kept: the memory bound); a failure
    there undoes the small states and raises as it was raised. Collective where ``fill`` is."""
    done: list[tuple[Step, Any]] = []
    for step in small_steps(plan):
        try:
            saved = step.save()
            done.append((step, saved))
            step.do()
        except Exception as err:
            saving = not done or done[-1][0] is not step
            raise _failed(plan.source, step, err, saving, not_undone=_undo(done, plan.source)) from err
    try:
        fill()
    except Exception:
        _undo(done, plan.source)
        raise
    for level, message in plan.notices:
        log_rank0(level, "%s", message)
    return plan.restore


def steps_of(plan: RestorePlan, *, collective: bool = False) -> list[Step]:
    """The steps that apply ``plan``, in the order of :data:`STEPS` (the parts ``plan.restore`` names); ``collective``:
    the ranks agree after them (so every step's undo must be possible). Local."""
    live = plan.objects
    steps = [_received_step(plan.landed)] if plan.landed else []
    steps += small_steps(plan)
    if live.optimizer is not None and plan.optimizer_state is not None:
        steps.append(_optimizer_step(plan))
    ema = live.ema if plan.ema_state is not None else None
    keep_model = collective or ema is not None or _can_raise(live.model)
    steps.append(_module_step("model", live.model, plan.model_state, plan.strict, plan, keep_model))
    if ema is not None and plan.ema_state is not None:
        steps.append(_module_step("ema", ema, plan.ema_state, plan.strict, plan, collective or _can_raise(ema)))
    return steps


def apply_plan(plan: RestorePlan, *, agree: Callable[[BaseException | None], None] | None = None) -> tuple[str, ...]:
    """Run ``plan``'s steps; on any failure undo every one already run and raise :class:`RestoreError` naming the
    part (chained to the original). Returns ``plan.restore``.

    Local, unless ``agree`` is given (collective: ``agree_across_ranks``): it is called on every rank with this
    rank's failure (or None) once the steps ran, and raises on the ranks that did not fail when another did;
    every rank then undoes its steps. The commits run once every rank succeeded.
    """
    done: list[tuple[Step, Any]] = []
    commits: list[Commit] = []
    failure: tuple[Step, Exception, bool] | None = None  # the step, what it raised, whether in save()
    for step in steps_of(plan, collective=agree is not None):
        try:
            saved = step.save()
            done.append((step, saved))
            commit = step.do()
        except Exception as err:
            failure = (step, err, not done or done[-1][0] is not step)
            break
        if commit is not None:
            commits.append(commit)
    error = None if failure is None else _failed(plan.source, *failure, not_undone=[])
    if agree is not None:
        try:
            agree(error)  # the other ranks raise this rank's RestoreError, relayed
        except DistResumeError:
            _undo(done, plan.source)
            raise
    if failure is not None and error is not None:
        not_undone = _undo(done, plan.source)
        raise (_failed(plan.source, *failure, not_undone=not_undone) if not_undone else error) from failure[1]
    for commit in commits:
        commit()
    for level, message in plan.notices:
        log_rank0(level, "%s", message)
    return plan.restore


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
