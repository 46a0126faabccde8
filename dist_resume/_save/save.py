"""Writing one checkpoint: its payload (canonical keys, loading under ``weights_only=True``), gathered by a collective
step, and one writer's atomic replacement (or the striped, sharded and gathered writes it hands over to)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._checkpoint.objects import LiveObjects
from .._checkpoint.plan.ema import canonical_ema_state
from .._core.errors import CheckpointWriteError
from .._core.location import Location
from .._core.log import log_saved
from .._core.text import article
from .._core.tree import structure_problem
from .._core.version import __version__
from .._dist.comm import collective_step, run_on_rank0
from .._dist.ddp_buckets import saved_layout
from .._dist.env import is_distributed
from .._exact.data import loop_epoch
from .._exact.rank_states import gather_rank_states, merge_rank_states
from .._exact.rng import param_device
from .._format.atomic import atomic_write
from .._layout.layout import FORMAT_NAME, FORMAT_VERSION, Key
from .._layout.meta import DDP_BUCKETS
from .._state.optim.prepare import canonical_optimizer_state
from .._state.prefix import canonical_state_dict, unwrap_model
from .._state.sharded import is_sharded
from .evidence import run_evidence
from .full_state import save_full
from .sharded import save_sharded
from .striped import save_striped, stripes

__all__ = [
    "write_checkpoint",
    "prepare_payload",
    "build_payload",
    "check_weights_only_safe",
    "tell",
]

_SAFE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.Tensor, torch.Size, torch.dtype, torch.device)


def check_weights_only_safe(obj: Any, path: str = "extra") -> None:
    """Raise :class:`CheckpointWriteError` if ``obj`` holds something ``torch.load(weights_only=True)`` refuses."""
    if type(obj) in _SAFE_LEAVES or isinstance(obj, torch.Tensor):
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            check_weights_only_safe(key, f"{path} key")
            check_weights_only_safe(value, f"{path}[{key!r}]")
        return
    if type(obj) in (list, tuple, set):  # weights_only refuses frozenset
        for i, value in enumerate(obj):
            check_weights_only_safe(value, f"{path}[{i}]")
        return
    hint = "vars(obj) or a dict of plain values"
    if isinstance(obj, str):
        hint = "str(obj)"
    raise CheckpointWriteError(
        f"{path} is {article(f'{type(obj).__module__}.{type(obj).__qualname__}')}, which torch.load(weights_only=True) "
        f"refuses, so the checkpoint could not be loaded safely; store {hint} instead"
    )


def build_payload(
    objects: LiveObjects,
    *,
    step: int | None = None,
    epoch: int | None = None,
    extra: Any = None,
    world_size: int = 1,
    rng: list[dict[str, Any]] | None = None,
    sampler: dict[str, Any] | None = None,
    ddp_buckets: list[list[int]] | None = None,
) -> dict[str, Any]:
    """The dict a dist_resume checkpoint holds: canonical model keys, canonical optimizer names, metadata
    (``ddp_buckets``: :func:`~dist_resume._dist.ddp_buckets.saved_layout`, read on every rank)."""
    problem = structure_problem(extra)  # before the recursive check below; a reader would refuse it too
    if problem is not None:
        raise CheckpointWriteError(
            f"extra cannot be saved in a checkpoint: {problem} (paths inside extra); store plain values "
            "that hold no reference to their own container"
        )
    check_weights_only_safe(extra)
    for name, value in (("step", step), ("epoch", epoch)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"{name} must be an int or None, got {type(value).__name__} {value!r}")
    model, optimizer = objects.model, objects.optimizer
    payload: dict[str, Any] = {
        Key.FORMAT: FORMAT_NAME,
        Key.VERSION: FORMAT_VERSION,
        Key.MODEL: canonical_state_dict(model),
        Key.META: {
            "step": step,
            "epoch": epoch,
            "world_size": world_size,
            "torch_version": str(torch.__version__),
            "dist_resume_version": __version__,
            "model_class": type(unwrap_model(model)).__name__,
            "optimizer_class": type(optimizer).__name__ if optimizer is not None else None,
            "saved_at": time.time(),
            **run_evidence(model, objects.data),  # what dist-resume check reads as evidence: see .evidence
        },
    }
    if ddp_buckets is not None:  # DDP's bucket layout, so that a resume's first step reduces in it
        payload[Key.META][DDP_BUCKETS] = ddp_buckets
    if optimizer is not None:
        payload[Key.OPTIMIZER] = canonical_optimizer_state(optimizer, model)
    if objects.scheduler is not None:
        payload[Key.SCHEDULER] = objects.scheduler.state_dict()
        check_weights_only_safe(payload[Key.SCHEDULER], "scheduler.state_dict()")
    if objects.scaler is not None:
        payload[Key.SCALER] = objects.scaler.state_dict()
    if extra is not None:
        payload[Key.EXTRA] = extra
    if rng is not None:  # one entry per rank, index = rank (see _exact.gather_rank_states)
        payload[Key.RNG] = rng
    if objects.ema is not None:  # the averaged module's canonical keys (+ n_averaged): see _checkpoint.plan.ema
        payload[Key.EMA] = canonical_ema_state(objects.ema)
    if sampler is not None:
        payload[Key.SAMPLER] = dict(sampler)
        check_weights_only_safe(payload[Key.SAMPLER], "sampler.state_dict()")
    return payload


def prepare_payload(
    objects: LiveObjects, *, step: int | None, epoch: int | None, extra: Any, rng: bool, everywhere: bool = False
) -> tuple[Callable[[], dict[str, Any]], int | None]:
    """The collective part of a save (every rank's RNG state and data position to rank 0, or to every rank with
    ``everywhere``); returns the payload builder (rank 0's, or every rank's) and the epoch saved: ``epoch``, or without
    one the epoch the loop continues in (the data position's)."""
    world_size = dist.get_world_size() if is_distributed() else 1
    data = objects.data
    position = data if data is None or isinstance(data, Mapping) else data.state_dict()
    epoch = loop_epoch(epoch, position, data)
    buckets = saved_layout(objects.model)  # every rank: it may rebuild DDP's buckets now, a collective
    rank_states = None
    if rng or position is not None:
        with collective_step("gathering every rank's RNG and sampler state for the checkpoint", CheckpointWriteError):
            rank_states = gather_rank_states(
                rng=rng, sampler=position, device=param_device(objects.model), everywhere=everywhere
            )

    def build() -> dict[str, Any]:
        rng_states, sampler_state = merge_rank_states(rank_states) if rank_states else (None, None)
        return build_payload(
            objects,
            step=step,
            epoch=epoch,
            extra=extra,
            world_size=world_size,
            rng=rng_states,
            sampler=sampler_state,
            ddp_buckets=buckets,
        )

    return build, epoch


def write_checkpoint(
    path: Location,
    build: Callable[[], dict[str, Any]],
    *,
    step: int | None,
    epoch: int | None,
    model: nn.Module | None = None,
    full_state: bool = False,
    started: float | None = None,
) -> Location:
    """Rank 0 builds the payload and writes it atomically; every rank returns its path (or raises rank 0's error).

    Collective under torch.distributed (one broadcast); local in a single process. An FSDP2 ``model`` is saved
    by every rank into a sharded checkpoint folder (:func:`~dist_resume._save.sharded.save_sharded`),
    or with ``full_state`` gathered into one file (:func:`~dist_resume._save.full_state.save_full`). A DDP ``model``
    saved to a local path is written by every rank, each its share of the records, into the one file
    (:func:`~dist_resume._save.striped.save_striped`), unless some rank cannot see the folder. Rank 0 logs the
    save's one line (:func:`~dist_resume._core.log.log_saved`), its time counted from ``started`` (a
    ``time.perf_counter()``; this call's start when None).
    """
    began = time.perf_counter() if started is None else started
    if model is not None and is_sharded(model):
        if full_state:
            return save_full(path, build, step=step, epoch=epoch, started=began)
        return save_sharded(path, build, model, step=step, epoch=epoch, started=began)
    dest = path
    if model is not None and isinstance(dest, Path) and stripes(model, dest, _world_size()):
        striped = save_striped(dest, build, model, step=step, epoch=epoch, started=began)
        if striped is not None:
            return striped

    def write() -> Location:
        payload = build()
        size: list[int | None] = [None]

        def dump(f: Any) -> None:
            torch.save(payload, f)
            size[0] = tell(f)

        dest = atomic_write(path, dump)
        log_saved(dest, step=step, epoch=epoch, size=size[0], seconds=time.perf_counter() - began)
        return dest

    result: Location = run_on_rank0(write)
    return result


def _world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def tell(f: Any) -> int | None:
    """The bytes written so far into ``f`` (a file ``torch.save`` wrote from its start: its size), or None when
    ``f`` cannot say. Local; never raises (a log line's size must not fail a save)."""
    try:
        return int(f.tell())
    except Exception:
        return None
