"""Process body for scripts/bench.py: re-keying a state dict of many entries, and proof that no tensor is copied."""

from __future__ import annotations

import gc
import statistics
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from _bench_proc import proc_status_kib
from torch import nn
from torch.nn.modules.utils import consume_prefix_in_state_dict_if_present

import dist_resume

__all__ = ["prefix_adapt"]

PER_MODULE = 200


class _Block(nn.Module):
    def __init__(self, numel: int) -> None:
        super().__init__()
        for j in range(PER_MODULE):
            self.register_buffer(f"b{j}", torch.zeros(numel))


class _Net(nn.Module):
    """``keys`` state-dict entries (buffers in blocks of 200) plus one parameter, so DDP accepts it."""

    def __init__(self, keys: int, numel: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(numel))
        self.blocks = nn.ModuleList(_Block(numel) for _ in range(max(1, (keys - 1) // PER_MODULE)))


def _timed(fn: Callable[[], Any], repeats: int) -> tuple[Any, list[float], tuple[float, float], dict[str, int]]:
    """Run ``fn`` ``repeats`` times; the last output (kept alive), the times, its window and RssAnon before/after."""
    times = []
    out = None
    for _ in range(repeats):
        out = None
        gc.collect()
        before = proc_status_kib()
        t0, start = time.monotonic(), time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
        window = (t0, time.monotonic())
        after = proc_status_kib()
    return out, times, window, {"before": before["RssAnon"], "after": after["RssAnon"]}


def _same_tensors(out: Mapping[str, Any], src: Mapping[str, Any], rename: Callable[[str], str]) -> dict[str, int]:
    """Count output entries that are not the very tensor (object and data_ptr) of the input under its old key."""
    by_key = {rename(k): v for k, v in src.items()}
    other_object = sum(1 for k, v in out.items() if v is not by_key[k])
    other_data = sum(1 for k, v in out.items() if v.data_ptr() != by_key[k].data_ptr())
    return {"entries": len(out), "other_object": other_object, "other_data_ptr": other_data}


def prefix_adapt(rank: int, world_size: int, keys: int, numel: int, repeats: int) -> dict[str, Any]:
    """adapt_state_dict (plain checkpoint -> DDP model) and strip_prefix (DDP state dict -> plain) at ``keys`` keys."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    inner = _Net(keys, numel)
    ddp = DDP(inner)
    plain = inner.state_dict()  # a canonical checkpoint's model state: no prefix
    wrapped = ddp.state_dict()  # what a DDP run would have saved without canonical keys
    tensor_bytes = sum(v.numel() * v.element_size() for v in plain.values())
    results: dict[str, Any] = {"keys": len(plain), "tensor_bytes": tensor_bytes}

    def add(name: str, fn: Callable[[], Any], src: Mapping[str, Any] | None, rename: Callable[[str], str]) -> None:
        out, times, window, anon = _timed(fn, repeats)
        entry: dict[str, Any] = {
            "median": statistics.median(times),
            "best": min(times),
            "window": window,
            "anon_delta_kib": anon["after"] - anon["before"],
            "anon_before_kib": anon["before"],
        }
        if src is not None:
            entry["copies"] = _same_tensors(out, src, rename)
        results[name] = entry

    add("adapt_state_dict", lambda: dist_resume.adapt_state_dict(plain, ddp), plain, lambda k: "module." + k)
    add("strip_prefix", lambda: dist_resume.strip_prefix(wrapped), wrapped, lambda k: k[len("module.") :])
    add("dict_add_prefix", lambda: OrderedDict(("module." + k, v) for k, v in plain.items()), None, str)
    add("dict_strip_prefix", lambda: OrderedDict((k[len("module.") :], v) for k, v in wrapped.items()), None, str)

    def torch_consume() -> Any:  # torch's own helper works in place: on a shallow copy, timed with the copy
        sd = OrderedDict(wrapped)
        consume_prefix_in_state_dict_if_present(sd, "module.")
        return sd

    add("torch_consume_prefix", torch_consume, None, str)
    return results
