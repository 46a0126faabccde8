"""Restore as a plan: validate every part of a checkpoint against the live objects, then apply it all at once."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .._core.errors import KeyMismatchError, OptimizerStateMismatchError, StateMismatchError
from .._core.rank import global_rank
from .._core.text import article
from .._core.tree import iter_tensors, map_tensors
from .._exact.rng import param_device, restore_rank_rng
from .._exact.sampler import check_sampler_state
from .._format.layout import CheckpointParts
from .._state.adapt import adapt_state_dict
from .._state.optim import optimizer_to, prepare_optimizer_state
from .._state.prefix import match_keys, model_key_map
from .._state.validate import check_dtypes, check_rng_states, check_scaler, check_scheduler

__all__ = ["RestorePlan", "plan_restore"]


@dataclass(frozen=True)
class RestorePlan:
    """What :func:`plan_restore` validated and :meth:`apply` will restore; nothing has changed yet.

    ``model_state`` is the checkpoint's model state re-keyed to ``model.state_dict()``'s form;
    ``optimizer_state`` the saved optimizer state paired with the live optimizer's parameters (None when
    the optimizer is not restored). ``restore`` and ``skipped`` name the parts, in the order
    :func:`resume` reports them.
    """

    parts: CheckpointParts
    model_state: OrderedDict[str, Any]
    optimizer_state: dict[str, Any] | None
    restore: tuple[str, ...]
    skipped: tuple[str, ...]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]
    model: nn.Module = field(repr=False)
    optimizer: torch.optim.Optimizer | None = field(repr=False)
    scheduler: Any = field(repr=False)
    scaler: Any = field(repr=False)
    sampler: Any = field(repr=False)
    strict: bool
    mmapped: bool
    source: str

    def apply(self) -> tuple[str, ...]:
        """Change the live objects; return the names of the parts restored (``self.restore``).

        Local. What can still fail goes first: GradScaler, scheduler, then the model; if the model load
        raises, scaler and scheduler are rolled back. The optimizer goes last, copied into its live state
        tensors where they exist (so no rollback copy of its state is ever held); state still aliasing a
        memory-mapped file is cloned; state is then moved onto its parameters' devices.
        """
        scaler = self.scaler if "scaler" in self.restore else None
        scheduler = self.scheduler if "scheduler" in self.restore else None
        before_scaler = scaler.state_dict() if scaler is not None else None
        before_scheduler = scheduler.state_dict() if scheduler is not None else None
        try:
            if scaler is not None:
                scaler.load_state_dict(self.parts.scaler)
            if scheduler is not None:
                scheduler.load_state_dict(self.parts.scheduler)
            self.model.load_state_dict(self.model_state, strict=self.strict)
        except Exception:
            if scaler is not None:
                scaler.load_state_dict(before_scaler)
            if scheduler is not None:
                scheduler.load_state_dict(before_scheduler)
            raise
        if self.optimizer is not None and self.optimizer_state is not None:
            self.optimizer.load_state_dict(_into_live_state(self.optimizer, self.optimizer_state))
            if self.mmapped:
                _detach_from_file(self.optimizer, _storage_ptrs(self.parts.optimizer))
            optimizer_to(self.optimizer)
        if "sampler" in self.restore:
            self.sampler.load_state_dict(self.parts.sampler)
        if "rng" in self.restore:
            restore_rank_rng(self.parts.rng, step=self.parts.step, device=param_device(self.model), source=self.source)
        return self.restore

    def destinations(self) -> dict[int, torch.Tensor]:
        """``{id(checkpoint tensor): live tensor}`` for each model entry and existing optimizer state tensor that
        the checkpoint's data can be written into directly (same shape and dtype, contiguous). Local."""
        out: dict[int, torch.Tensor] = {}
        live = self.model.state_dict(keep_vars=True)
        for key, value in self.model_state.items():
            if _fits(value, live.get(key)):
                out[id(value)] = live[key].detach()
        if self.optimizer is not None and self.optimizer_state is not None:
            for _, _, value, dst in _live_twins(self.optimizer, self.optimizer_state):
                if dst.is_contiguous():
                    out[id(value)] = dst
        return out

    def rebind(self, arrived: Mapping[int, torch.Tensor]) -> RestorePlan:
        """This plan with each tensor ``t`` replaced by ``arrived[id(t)]`` where given. Local; validates nothing.

        Under broadcast loading the plan is built on stand-ins before the data moves; this points it at
        the tensors the data arrived in.
        """

        def swap(obj: Any) -> Any:
            return map_tensors(obj, lambda t: arrived.get(id(t), t))

        parts = dataclasses.replace(
            self.parts,
            **{
                f: swap(getattr(self.parts, f)) for f in ("model", "optimizer", "scheduler", "scaler", "rng", "sampler")
            },
            meta=swap(self.parts.meta),
            extra=swap(self.parts.extra),
        )
        return dataclasses.replace(
            self, parts=parts, model_state=swap(self.model_state), optimizer_state=swap(self.optimizer_state)
        )


def plan_restore(
    parts: CheckpointParts,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    sampler: Any = None,
    rng: bool = False,
    strict: bool = True,
    source: str = "checkpoint",
    mmapped: bool = False,
) -> RestorePlan:
    """Validate every part of ``parts`` against the live objects and say what :meth:`RestorePlan.apply` will do.

    Local; changes nothing. Checks model keys, shapes and dtypes, the optimizer's class, groups, parameter
    names and state shapes, the LR scheduler's and GradScaler's state, the sampler position and this rank's
    RNG entry. A part the checkpoint lacks raises under ``strict``, else it is skipped. ``mmapped`` says
    that the checkpoint's tensors map its file: apply then clones the optimizer state that would alias it.
    """
    model_state, missing, unexpected = _plan_model(parts, model, strict, source)
    optimizer_state = None
    if optimizer is not None and _present(parts, parts.optimizer, "optimizer", strict, source):
        saved_class = parts.meta.get("optimizer_class")
        if saved_class and saved_class != type(optimizer).__name__:
            raise OptimizerStateMismatchError(
                f"{source}: the optimizer state was saved from {saved_class}, this optimizer is "
                f"{type(optimizer).__name__}; build {article(saved_class)}, or pass strict=False and no optimizer"
            )
        optimizer_state = prepare_optimizer_state(parts.optimizer, optimizer, model, source=source)
    has_scheduler = scheduler is not None and _present(parts, parts.scheduler, "scheduler", strict, source)
    if has_scheduler:
        check_scheduler(parts.scheduler, scheduler, source)
    has_scaler = scaler is not None and _present(parts, parts.scaler, "scaler", strict, source)
    empty_scaler = has_scaler and not parts.scaler and not strict  # a disabled scaler's {}: keep the fresh state
    if has_scaler and not empty_scaler:
        check_scaler(parts.scaler, scaler, source)
    hint = "pass strict=False to start the epoch afresh, or do not pass the sampler"
    has_sampler = sampler is not None and _present(parts, parts.sampler, "sampler", strict, source, hint)
    if has_sampler:
        check_sampler_state(sampler, parts.sampler, source)
    if rng:
        check_rng_states(parts.rng, global_rank(), source)
    wanted = {"optimizer": optimizer, "scheduler": scheduler, "scaler": scaler, "sampler": sampler}
    done = {
        "model": True,
        "scaler": has_scaler and not empty_scaler,
        "optimizer": optimizer_state is not None,
        "scheduler": has_scheduler,
        "sampler": has_sampler,
        "rng": rng and parts.rng is not None,
    }
    skipped = [name for name in ("optimizer", "scheduler", "scaler", "sampler") if wanted[name] is not None]
    return RestorePlan(
        parts=parts,
        model_state=model_state,
        optimizer_state=optimizer_state,
        restore=tuple(name for name, yes in done.items() if yes),
        skipped=tuple(name for name in skipped if not done[name]),
        missing_keys=tuple(missing),
        unexpected_keys=tuple(unexpected),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        sampler=sampler,
        strict=strict,
        mmapped=mmapped,
        source=source,
    )


def _plan_model(
    parts: CheckpointParts, model: nn.Module, strict: bool, source: str
) -> tuple[OrderedDict[str, Any], list[str], list[str]]:
    """The model state re-keyed to ``model``'s form, the live keys it lacks and the saved keys it drops."""
    try:
        adapted = adapt_state_dict(parts.model, model, strict=strict)
    except KeyMismatchError as err:  # say which file
        raise KeyMismatchError(
            f"{source}: {err}", missing=err.missing, unexpected=err.unexpected, mismatched=err.mismatched
        ) from err
    check_dtypes(adapted, model, strict, source)
    missing = [k for k in model.state_dict().keys() if k not in adapted]
    unexpected: list[str] = []
    if len(adapted) < len(parts.model):  # saved keys are in the file's form: compare through the pairing
        paired = match_keys(parts.model.keys(), model_key_map(model))
        unexpected = [k for k in parts.model if k not in paired]
    return adapted, missing, unexpected


def _present(parts: CheckpointParts, entry: Any, what: str, strict: bool, source: str, hint: str = "") -> bool:
    """Whether the checkpoint holds ``what``'s state; when it does not, raise under ``strict``."""
    if entry is not None:
        return True
    if strict:
        raise StateMismatchError(
            f"{source} ({parts.layout.value} layout) has no {what} state but {article(what)} was passed; "
            + (hint or f"pass strict=False to restore what the file has, or do not pass the {what}")
        )
    return False


def _fits(src: Any, dst: Any) -> bool:
    return (
        isinstance(src, torch.Tensor)
        and isinstance(dst, torch.Tensor)
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and dst.is_contiguous()
    )


def _live_twins(
    optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]
) -> Iterator[tuple[Any, str, torch.Tensor, torch.Tensor]]:
    """``(saved id, key, saved tensor, live tensor)`` for each saved state tensor whose live counterpart (same
    parameter and key) already exists with the same shape and dtype. ``opt_sd`` comes from prepare_optimizer_state."""
    saved_ids = [i for group in opt_sd["param_groups"] for i in group["params"]]
    live_params = [p for group in optimizer.param_groups for p in group["params"]]
    for sid, param in zip(saved_ids, live_params):
        live_state = optimizer.state.get(param, {})
        for key, value in (opt_sd["state"].get(sid) or {}).items():
            dst = live_state.get(key)
            if (
                isinstance(value, torch.Tensor)
                and isinstance(dst, torch.Tensor)
                and dst.shape == value.shape
                and dst.dtype == value.dtype
            ):
                yield sid, key, value, dst


def _into_live_state(optimizer: torch.optim.Optimizer, opt_sd: dict[str, Any]) -> dict[str, Any]:
    """``opt_sd`` with each saved state tensor that has a live twin copied into that twin and replaced by it:
    torch's load_state_dict then keeps it as it is. Data that arrived in the twin itself is not copied."""
    state = {sid: dict(entries) for sid, entries in opt_sd["state"].items()}
    with torch.no_grad():
        for sid, key, value, dst in _live_twins(optimizer, opt_sd):
            if value is not dst:
                dst.copy_(value)
            state[sid][key] = dst
    return {**opt_sd, "state": state}


def _storage_ptrs(obj: Any) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in iter_tensors(obj) if t.device.type == "cpu"}


def _detach_from_file(optimizer: torch.optim.Optimizer, loaded: set[int]) -> None:
    """Clone state tensors that still alias the memory-mapped checkpoint (CPU params, same dtype)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if (
                isinstance(value, torch.Tensor)
                and value.device.type == "cpu"
                and value.untyped_storage().data_ptr() in loaded
            ):
                state[key] = value.clone()
