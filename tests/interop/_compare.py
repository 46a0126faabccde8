"""Deep equality of nested state (tensors compared with ``torch.equal``, dtype included)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Fail naming the first path where ``got`` and ``want`` differ."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: {type(got).__name__}, want a tensor"
        assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype}{tuple(got.shape)}"
        assert torch.equal(got.cpu(), want.cpu()), f"{where}: values differ"
    elif isinstance(want, Mapping):
        assert isinstance(got, Mapping), f"{where}: {type(got).__name__}, want a mapping"
        # key sets, not order: safetensors stores tensors sorted by name
        assert set(got) == set(want), f"{where}: keys {sorted(map(str, got))[:6]} != {sorted(map(str, want))[:6]}"
        for key in want:
            assert_same(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: {got!r} != {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def loads_into(optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Load ``state`` and check every parameter really got state (load_state_dict may drop it silently)."""
    optimizer.load_state_dict(state)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(optimizer.state.get(p) for p in params), "some parameters got no optimizer state"
