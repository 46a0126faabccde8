"""Tiny models and helpers shared by the single-process tests (kept small so every test is fast)."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

__all__ = [
    "TinyNet",
    "TwinNet",
    "TwinNetReordered",
    "WRAPPERS",
    "compile_module",
    "wrap",
    "make_batches",
    "batches_on",
    "state_devices",
    "train_steps",
    "snapshot",
    "assert_same",
    "single_rank_group",
]


class TinyNet(nn.Module):
    """A linear layer, a child literally named ``submodule`` (the ``replace("module.", "")`` trap) and a
    BatchNorm (``_metadata`` version 2, an int64 buffer)."""

    def __init__(self, seed: int = 0, width: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc = nn.Linear(4, width)
        self.submodule = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.bn(torch.relu(self.submodule(torch.relu(self.fc(x))))))


class TwinNet(nn.Module):
    """Two same-shaped layers: positional optimizer matching cannot tell them apart."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class TwinNetReordered(nn.Module):
    """Same names and shapes as :class:`TwinNet`, registered in the opposite order."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.b = nn.Linear(3, 3)
        self.a = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def compile_module(m: nn.Module) -> nn.Module:
    """``torch.compile(m)``: an OptimizedModule (an nn.Module, "_orig_mod." keys), typed as one (torch types the
    result of torch.compile as a plain callable). Creating it compiles nothing until it is called."""
    return cast(nn.Module, torch.compile(m))


# wrapper name -> (function, the key prefix it adds). DP works on a CPU-only host (no device_ids).
WRAPPERS: dict[str, tuple[Callable[[nn.Module], nn.Module], str]] = {
    "plain": (lambda m: m, ""),
    "dp": (nn.DataParallel, "module."),
    "compiled": (compile_module, "_orig_mod."),
    "dp_dp": (lambda m: nn.DataParallel(nn.DataParallel(m)), "module.module."),
    "compile_dp": (lambda m: compile_module(nn.DataParallel(m)), "_orig_mod.module."),
    "dp_compile": (lambda m: nn.DataParallel(compile_module(m)), "module._orig_mod."),
}


def wrap(model: nn.Module, kind: str) -> nn.Module:
    return WRAPPERS[kind][0](model)


def make_batches(n: int, seed: int = 123, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=g), torch.randn(batch, 2, generator=g)) for _ in range(n)]


def batches_on(
    batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``batches`` with every tensor moved to ``device``."""
    return [(x.to(device), y.to(device)) for x, y in batches]


def state_devices(optimizer: torch.optim.Optimizer, key: str) -> set[torch.device]:
    """The devices of ``optimizer.state[p][key]`` over every parameter that has it."""
    return {
        optimizer.state[p][key].device
        for group in optimizer.param_groups
        for p in group["params"]
        if key in optimizer.state.get(p, {})
    }


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    scheduler: Any = None,
    scaler: Any = None,
) -> list[float]:
    """One optimizer step per batch; returns the losses (exact floats, for bitwise comparisons)."""
    losses = []
    model.train()
    for x, y in batches:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        else:
            loss.backward()
            optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def snapshot(
    model: nn.Module | None = None, optimizer: Any = None, scheduler: Any = None, scaler: Any = None
) -> dict[str, Any]:
    """Deep copies of every piece of state, to compare bytewise later."""
    out: dict[str, Any] = {}
    if model is not None:
        out["model"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out["param_ids"] = [id(p) for p in model.parameters()]
    if optimizer is not None:
        out["optimizer"] = copy.deepcopy(optimizer.state_dict())
    if scheduler is not None:
        out["scheduler"] = copy.deepcopy(scheduler.state_dict())
    if scaler is not None:
        out["scaler"] = copy.deepcopy(scaler.state_dict())
    return out


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Recursive equality; tensors must match in dtype, shape, device and every byte."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), f"{path}: {type(a)} vs {type(b)}"
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} vs {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} vs {tuple(b.shape)}"
        assert a.device == b.device, f"{path}: device {a.device} vs {b.device}"
        assert torch.equal(_tensor_bytes(a), _tensor_bytes(b)), f"{path}: bytes differ"
    elif isinstance(a, Mapping):
        assert isinstance(b, Mapping), f"{path}: {type(a)} vs {type(b)}"
        assert set(a.keys()) == set(b.keys()), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@contextlib.contextmanager
def single_rank_group(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo process group (FileStore rendezvous in ``tmp_path``), destroyed on exit."""
    assert not dist.is_initialized(), "a process group leaked from another test"
    store = dist.FileStore(str(tmp_path / "pg_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()
