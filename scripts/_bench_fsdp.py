"""Process bodies for scripts/bench_fsdp.py: a full checkpoint into an FSDP2 model (four ways), and back (three).

Each body builds ``layers`` x Linear(width, width) sharded with fully_shard (per layer, then the root) on a
CPU mesh, an AdamW over it, and reports the ``time.monotonic()`` window of the measured step, its own
RssAnon at the window's start (after ``malloc_trim``: freed heap is back with the kernel, so what the
step touches shows as growth) and the rank's shard size (its parameters and their two Adam moments).
"""

from __future__ import annotations

import ctypes
import gc
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _bench_proc import proc_status_kib
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dist_resume._core.shards import local_of, shard_spec
from dist_resume._core.tree import map_tensors
from dist_resume._dist.comm import broadcast_object
from dist_resume._dist.shard_comm import scatter_full_into
from dist_resume._format.stream_write import distinct_tensors, write_streamed
from dist_resume._save.full_state import save_full_state
from dist_resume._state.optim.prepare import prepare_optimizer_state
from dist_resume._state.optim.sharded import load_full_optimizer_state, sharded_optimizer_state
from dist_resume._state.sharded import load_full_model_state, model_destinations

__all__ = ["make_checkpoint", "load_rank", "save_rank", "LOADS", "SAVES"]

LOADS = ("dsd_broadcast", "dsd_each", "ours_each", "ours_scatter")
SAVES = ("dsd_full", "full_tensor", "ours")


def _build(width: int, layers: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)


def make_checkpoint(rank: int, world_size: int, path: str, width: int, layers: int) -> int:
    """The single-process run that saved the checkpoint: weights, AdamW after one step. Returns its size."""
    model = _build(width, layers, seed=0)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    _step(model, opt)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    import os

    return os.path.getsize(path)


def _sharded(world_size: int, width: int, layers: int, warm: bool) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    mesh = init_device_mesh("cpu", (world_size,))
    with torch.device("meta"):  # no rank ever holds the whole model
        model = _build(width, layers, seed=1)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            local_of(p).normal_(0, 0.02)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if warm:
        _step(model, opt)  # the state exists: resume after a rollback, or state built eagerly
    shard = sum(local_of(p).nbytes for p in model.parameters()) * 3
    return model, opt, shard


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _by_name(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """Integer-keyed optimizer state keyed by parameter name, the form DSD needs (FACTS 33)."""
    groups = [
        {k: v for k, v in g.items() if k != "param_names"} | {"params": [names[i] for i in g["params"]]}
        for g in osd["param_groups"]
    ]
    return {"state": {names[i]: dict(s) for i, s in osd["state"].items()}, "param_groups": groups}


def _skeleton(obj: Any) -> Any:
    """What rank 0 sends ahead of the data: the structure, tensors as (shape, dtype)."""
    return map_tensors(obj, lambda t: ("tensor", tuple(t.shape), t.dtype))


def _stand_ins(skeleton: Any) -> Any:
    def meta(node: Any) -> Any:
        if isinstance(node, tuple) and len(node) == 3 and node[0] == "tensor":
            return torch.empty(node[1], dtype=node[2], device="meta")
        if isinstance(node, dict):
            return {k: meta(v) for k, v in node.items()}
        if isinstance(node, list):
            return [meta(v) for v in node]
        return node

    return meta(skeleton)


def _load(how: str, path: str, model: nn.Module, opt: torch.optim.Optimizer, rank: int) -> None:
    names = [n for n, _ in model.named_parameters()]
    if how.startswith("dsd"):
        broadcast = how == "dsd_broadcast"
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
        if rank == 0 or not broadcast:
            saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
            msd, osd = dict(saved["model"]), _by_name(saved["optimizer"], names)
        else:
            msd, osd = {}, {}
        set_model_state_dict(model, msd, options=options)
        set_optimizer_state_dict(model, opt, osd, options=options)
    elif how == "ours_each":
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        load_full_model_state(model, saved["model"])
        load_full_optimizer_state(opt, prepare_optimizer_state(saved["optimizer"], opt, model))
    elif how == "ours_scatter":  # rank 0 alone reads the file (a node-local disk)
        saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True) if rank == 0 else None
        skeleton = broadcast_object(_skeleton(saved) if rank == 0 else None)
        source = saved if rank == 0 else _stand_ins(skeleton)
        assert source is not None
        pairs = [(full, dst) for _, full, dst in model_destinations(model, source["model"])]
        opt_sd, opt_pairs = sharded_optimizer_state(opt, prepare_optimizer_state(source["optimizer"], opt, model))
        scatter_full_into(pairs + opt_pairs)
        opt.load_state_dict(opt_sd)
    else:
        raise ValueError(how)


def _matches(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Every local shard (weights and both moments) equals its box of the file, and step is 1."""
    saved = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    for i, (name, p) in enumerate(model.named_parameters()):
        box = shard_spec(p).slices()
        if not torch.equal(local_of(p), saved["model"][name][box]):
            return False
        state = opt.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.equal(local_of(state[key]), saved["optimizer"]["state"][i][key][box]):
                return False
        if float(state["step"]) != 1.0:
            return False
    return True


def load_rank(rank: int, world_size: int, path: str, width: int, layers: int, how: str, warm: bool) -> dict[str, Any]:
    model, opt, shard = _sharded(world_size, width, layers, warm)
    _trim()
    dist.barrier()
    anon0 = proc_status_kib()["RssAnon"]
    start = time.monotonic()
    _load(how, path, model, opt, rank)
    end = time.monotonic()
    dist.barrier()
    return {"window": (start, end), "anon0_kib": anon0, "shard": shard, "ok": _matches(path, model, opt)}


def save_rank(rank: int, world_size: int, path: str, width: int, layers: int, how: str) -> dict[str, Any]:
    model, opt, shard = _sharded(world_size, width, layers, warm=True)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    _trim()
    dist.barrier()
    anon0 = proc_status_kib()["RssAnon"]
    start = time.monotonic()
    if how == "dsd_full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {
            "model": get_model_state_dict(model, options=options),
            "optimizer": get_optimizer_state_dict(model, opt, options=options),
        }
        if rank == 0:
            torch.save(full, path)
        del full
    elif how == "full_tensor":  # DTensor.full_tensor() per tensor: collective, the full value on every rank
        if rank == 0:
            import os

            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            write_streamed(fd, state, lambda i, t: (_full(t),))
            os.close(fd)
        else:
            for t in distinct_tensors(state):
                _full(t)
    elif how == "ours":
        save_full_state(Path(path), state)
    else:
        raise ValueError(how)
    end = time.monotonic()
    dist.barrier()
    ok = True
    if rank == 0:
        written = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        model_sd = written["model"]
        ok = len(model_sd) == 2 * layers and all(
            tuple(model_sd[n].shape) == tuple(p.shape) for n, p in model.named_parameters()
        )
    return {"window": (start, end), "anon0_kib": anon0, "shard": shard, "ok": ok}


def _full(t: torch.Tensor) -> torch.Tensor:
    from dist_resume._core.shards import is_dtensor

    return t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined, no-any-return]
