"""Checks of a checkpoint's model dtypes, LR scheduler, GradScaler and RNG state against the live objects."""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Callable, Mapping
from typing import Any, Final

import torch
from torch import nn

from .._core.bounds import MAX_INT64
from .._core.errors import KeyMismatchError, StateMismatchError
from .._core.text import article, described, preview

__all__ = ["check_dtypes", "check_scheduler", "check_scaler", "check_rng_states", "rng_state_problem", "is_number"]


def check_dtypes(adapted: Mapping[str, Any], model: nn.Module, strict: bool, source: str) -> None:
    live = model.state_dict(keep_vars=True)
    problems = []
    for key, value in adapted.items():
        want = live.get(key)
        if not (isinstance(value, torch.Tensor) and isinstance(want, torch.Tensor)) or value.dtype == want.dtype:
            continue
        cast_ok = value.is_floating_point() and want.is_floating_point()
        if strict or not cast_ok:
            problems.append(f"{key}: checkpoint {value.dtype}, model {want.dtype}")
    if problems:
        shown = preview(problems, 5, sep="; ", quote=False)
        raise KeyMismatchError(
            f"{source}: dtypes differ ({shown}); convert the model (model.to(dtype)) to the checkpoint's dtype "
            "before resuming, or pass options=ResumeOptions(strict=False) to cast floating-point tensors on load",
            mismatched=problems,
        )


def check_scheduler(saved: Any, scheduler: Any, source: str) -> None:
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{source}: the scheduler entry is {article(type(saved).__name__)}, not a state dict")
    live = scheduler.state_dict()
    if set(saved) != set(live):
        unexpected = sorted(map(described, set(saved) - set(live)))  # a damaged file's keys: any type
        raise StateMismatchError(
            f"{source}: the saved LR scheduler state does not fit {type(scheduler).__name__} (saved keys "
            f"[{', '.join(unexpected)}] not expected, {sorted(set(live) - set(saved))} missing); "
            "build the same scheduler class as the run that saved it"
        )
    if odd := [
        f"{key}={described(saved[key], 40)}" for key, value in live.items() if not _same_kind(value, saved[key])
    ]:
        raise StateMismatchError(
            f"{source}: the saved LR scheduler state holds values of another kind than "
            f"{type(scheduler).__name__}'s ({preview(odd, 3, quote=False)}); the checkpoint is damaged or was edited: "
            "resume from another checkpoint, or without the scheduler and build a fresh one"
        )
    # LambdaLR/MultiplicativeLR update each lambda's __dict__, SequentialLR/ChainedScheduler load each inner
    # scheduler, after the attributes: one entry per live one, of the kind they load, or a half-loaded scheduler
    lambdas, inner = saved.get("lr_lambdas"), saved.get("_schedulers")
    if "lr_lambdas" in saved and not _one_each(
        lambdas, scheduler.lr_lambdas, lambda x: x is None or isinstance(x, Mapping)
    ):
        raise StateMismatchError(f"{source}: the LR scheduler's 'lr_lambdas' {_NOT_ONE_EACH}")
    if "_schedulers" in saved and not _one_each(inner, scheduler._schedulers, lambda x: isinstance(x, Mapping)):
        raise StateMismatchError(f"{source}: the LR scheduler's '_schedulers' {_NOT_ONE_EACH}")
    for entry, live_one in zip(inner or (), getattr(scheduler, "_schedulers", ())):
        check_scheduler(entry, live_one, source)


_NOT_ONE_EACH: Final = (
    "are not one state per scheduled function or scheduler of this one; the checkpoint is damaged or was edited, or "
    "was saved from another configuration: build the same scheduler as the run that saved it"
)


def _same_kind(live: Any, saved: Any) -> bool:
    """Whether ``saved`` is what a scheduler's load can take where the live one holds ``live``: a flag for a flag, a
    finite number for a counter (``last_epoch``, ``step_size``), a number for a number, as many numbers for a
    list of numbers (``base_lrs``: one per param group). Anything else (an inner state, a mode's name) as it is."""
    if isinstance(live, bool):
        return isinstance(saved, bool)
    if type(live) is int:  # a counter, or a factor given as an int: never NaN, infinite or past int64
        return is_number(saved) and (not isinstance(saved, float) or math.isfinite(saved))
    if is_number(live):
        return is_number(saved)
    if isinstance(live, (list, tuple)) and live and all(map(is_number, live)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(live) and all(map(is_number, saved))
    return True


def _one_each(saved: Any, live: Any, fits: Callable[[Any], bool]) -> bool:
    return isinstance(saved, (list, tuple)) and len(saved) == len(live) and all(map(fits, saved))


# what GradScaler.load_state_dict reads from an enabled scaler's state (torch 2.x): each a plain number
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_SCALER_FILLED = {"scale": torch.float32, "_growth_tracker": torch.int32}  # GradScaler's _scale, _growth_tracker


def check_scaler(saved: Any, scaler: Any, source: str) -> None:
    """Raise :class:`StateMismatchError` unless ``scaler.load_state_dict(saved)`` can only succeed. Local.

    A disabled scaler ignores what it is given; an enabled one needs every number it reads.
    """
    if not isinstance(saved, Mapping):
        raise StateMismatchError(f"{source}: the GradScaler entry is {article(type(saved).__name__)}, not a state dict")
    if not scaler.is_enabled():
        return
    if not saved:
        raise StateMismatchError(
            f"{source}: the GradScaler state is empty (it was saved from a disabled scaler) but this scaler is "
            "enabled; pass options=ResumeOptions(strict=False) to keep the scaler's fresh state"
        )
    problems = [
        f"{key}: {'missing' if key not in saved else type(saved[key]).__name__}"
        for key in _SCALER_KEYS
        if not is_number(saved.get(key))
    ]
    if not problems:  # load_state_dict fills the scaler's own tensors with these two: each must fit their dtype
        problems = [
            f"{refused} as a {dtype} value"
            for key, dtype in _SCALER_FILLED.items()
            if (refused := _tried(key, functools.partial(_fill, dtype, saved[key])))
        ]
    if problems:
        raise StateMismatchError(
            f"{source}: the GradScaler state is not one GradScaler.state_dict() writes ({'; '.join(problems)}; "
            f"expected numbers under {list(_SCALER_KEYS)}); the checkpoint is damaged or was edited: resume "
            "from another checkpoint, or restore without the scaler and keep its fresh state"
        )


def _fill(dtype: torch.dtype, value: Any) -> None:
    if not (isinstance(value, torch.Tensor) and value.is_meta):  # a stand-in: its value is checked where it is
        torch.empty((), dtype=dtype).fill_(value)


def is_number(value: Any) -> bool:
    """A plain number (an int within int64), or a one-element real tensor (a GradScaler's scale, a capturable
    optimizer's lr)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and not value.is_complex()
    if type(value) is int:
        return -MAX_INT64 <= value <= MAX_INT64  # what torch takes as a number (float() of more overflows)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_rng_states(states: Any, rank: int, source: str) -> None:
    """Raise :class:`StateMismatchError` if ``rank`` cannot restore its RNG streams from ``states``. Local.

    ``states`` is a checkpoint's per-rank list (None: the file has none, nothing to check). A rank
    within the list needs its own entry, every stream of which the generators accept (see
    :func:`rng_state_problem`); a rank beyond it derives its streams from entry 0's integer seed.
    """
    if states is None:
        return
    if not isinstance(states, (list, tuple)) or not states:
        raise StateMismatchError(
            f"{source}: the RNG entry is {article(type(states).__name__)}, not a list of per-rank states"
        )
    own = rank < len(states)
    entry, needed = (states[rank], {"python", "torch"}) if own else (states[0], {"seed"})
    if not isinstance(entry, Mapping) or not needed <= set(entry):
        found = sorted(map(str, entry)) if isinstance(entry, Mapping) else type(entry).__name__
        raise StateMismatchError(
            f"{source}: the RNG state of rank {rank if own else 0} lacks {sorted(needed)} (found {found}); "
            "it was not written by save_checkpoint(rng=True); resume with ResumeOptions(rng=False) to keep the current streams"
        )
    problem = rng_state_problem(entry) if own else _seed_problem(entry["seed"])
    if problem is not None:
        raise StateMismatchError(
            f"{source}: the RNG state of rank {rank if own else 0} is not one rng_state_dict() writes: {problem}; "
            "the checkpoint is damaged or was edited: resume from another checkpoint, or with "
            "ResumeOptions(rng=False) to keep the current streams"
        )


def rng_state_problem(state: Any) -> str | None:
    """What restoring ``state`` (one rank's :func:`~dist_resume.rng_state_dict`) would fail on, or None. Local.

    Each stream is set on a throwaway generator (python ``random.Random``, ``torch.Generator``, numpy
    ``RandomState``) exactly as ``load_rng_state_dict`` sets the process's own, so nothing changes here and a
    state that passes cannot fail half-way through a restore. A meta stand-in (a rank that plans before a
    broadcast's data arrives) is checked for its shape; its content is checked where the data is.
    """
    if not isinstance(state, Mapping) or not {"python", "torch"} <= set(state):
        found = f"keys {sorted(map(str, state))}" if isinstance(state, Mapping) else article(type(state).__name__)
        return f"{found}, not a mapping with 'python' and 'torch' streams"
    py, cpu = state["python"], state["torch"]
    if not (isinstance(py, (list, tuple)) and len(py) == 3 and isinstance(py[1], (list, tuple))):
        return f"the python stream is {article(type(py).__name__)}, not random.getstate()'s (version, ints, gauss)"
    if len(py[1]) != len(random.getstate()[1]):  # before tuple() walks it: its length is what the file stored
        return f"the python stream holds {len(py[1])} ints, not the {len(random.getstate()[1])} of random.getstate()"
    problem = _tried("the python stream", lambda: random.Random().setstate((py[0], tuple(py[1]), py[2])))
    if problem is None and not isinstance(cpu, torch.Tensor):
        problem = f"the torch stream is {article(type(cpu).__name__)}, not a tensor"
    if problem is None:
        cpu = _stand_in(cpu, torch.get_rng_state())
        problem = _tried("the torch stream", lambda: torch.Generator().set_state(cpu.to("cpu", torch.uint8)))
    if problem is None:
        problem = _device_problem(state.get("device"), state.get("cuda"))
    numpy_state = state.get("numpy")
    if problem is None and numpy_state is not None:
        problem = _numpy_problem(numpy_state)
    return problem


def _device_problem(entry: Any, legacy: Any) -> str | None:
    """The device stream: None, ``{"type": str, "state": a vector of bytes}`` or (dist_resume 0.2) a bare tensor under
    ``"cuda"``. Its size only the device's own generator knows: it is set last, on that device."""
    if entry is None:
        entry = {"type": "cuda", "state": legacy} if legacy is not None else None
    if entry is None:
        return None
    saved = entry.get("state") if isinstance(entry, Mapping) else None
    if not isinstance(entry.get("type") if isinstance(entry, Mapping) else None, str) or not isinstance(
        saved, torch.Tensor
    ):
        found = (
            f"a mapping with keys {sorted(map(str, entry))}"
            if isinstance(entry, Mapping)
            else article(type(entry).__name__)
        )
        return f"the device stream is {found}, not {{'type': str, 'state': tensor}}"
    if saved.dim() != 1:
        return f"the device stream is a {tuple(saved.shape)} tensor, not a vector of bytes"
    return None


def _numpy_problem(saved: Any) -> str | None:
    try:
        import numpy as np
    except ImportError:  # not restored either (load_rng_state_dict says so)
        return None
    if not isinstance(saved, Mapping) or not isinstance(saved.get("keys"), torch.Tensor):
        return "the numpy stream is not a mapping with a 'keys' tensor"

    def apply() -> None:
        keys = _stand_in(saved["keys"], torch.zeros(624, dtype=torch.int64)).cpu().numpy().astype(np.uint32)
        fields = (saved["bit_generator"], keys, saved["pos"], saved["has_gauss"], saved["cached_gaussian"])
        np.random.RandomState().set_state(fields)

    return _tried("the numpy stream", apply)


def _stand_in(saved: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``saved``, or ``like`` for a meta stand-in of ``like``'s shape (the shape is what a stand-in can show)."""
    return like if saved.is_meta and saved.shape == like.shape else saved


def _tried(what: str, apply: Callable[[], object]) -> str | None:
    """None if ``apply()`` (setting a throwaway generator) succeeds, else what it raised."""
    try:
        apply()
    except Exception as err:  # whatever the generator refuses, the live one would refuse too, half-way through
        return f"{what} is refused ({type(err).__name__}: {str(err)[:120]})"
    return None


def _seed_problem(seed: Any) -> str | None:
    if isinstance(seed, int) and not isinstance(seed, bool):
        return None
    return f"the seed is {article(type(seed).__name__)}, not an int"
