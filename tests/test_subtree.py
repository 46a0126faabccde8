"""key_prefix: one sub-tree of a checkpoint's model state (Lightning's ``model.``), and the hint that names it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._state.subtree import select_prefix, suggest_key_prefix


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


def _lightning_state(inner: nn.Module) -> dict[str, torch.Tensor]:
    """What a LightningModule holding ``self.model = inner`` (and a loss with a weight) saves as state_dict."""
    holder = nn.Module()
    holder.model = inner
    holder.loss = nn.CrossEntropyLoss(weight=torch.ones(2))
    return holder.state_dict()


def test_key_prefix_loads_the_sub_tree_and_ignores_the_rest():
    src, dst = _net(), _net()
    state = _lightning_state(src)
    assert "loss.weight" in state
    adapted = dr.adapt_state_dict(state, dst, key_prefix="model.")
    assert list(adapted) == list(dst.state_dict())
    dst.load_state_dict(adapted)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name
    # module versions (BatchNorm's _metadata) follow the keys
    assert adapted._metadata["1"] == state._metadata["model.1"]  # type: ignore[attr-defined]


def test_key_prefix_into_a_ddp_shaped_model():
    wrapped = nn.DataParallel(_net())  # module.* keys, like DDP
    adapted = dr.adapt_state_dict(_lightning_state(_net()), wrapped, key_prefix="model.")
    assert all(k.startswith("module.") for k in adapted)


def test_key_prefix_that_matches_nothing_names_the_prefixes_present():
    with pytest.raises(dr.errors.KeyMismatchError, match=r"key_prefix='net\.'.*'loss\.', 'model\.'"):
        dr.adapt_state_dict(_lightning_state(_net()), _net(), key_prefix="net.")
    with pytest.raises(dr.errors.UsageError, match=r"ending in '\.'"):
        select_prefix({"model.w": torch.zeros(1)}, "model")


def test_a_mismatch_hint_names_the_key_prefix_that_would_fit():
    state = {k: v for k, v in _lightning_state(_net()).items() if k.startswith("model.")}  # all under model.
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.adapt_state_dict(state, _net())
    text = str(info.value)
    assert "pass key_prefix='model.'" in text and "strict=False" not in text
    assert info.value.missing and info.value.unexpected


def test_no_hint_when_no_prefix_fits():
    other = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        dr.adapt_state_dict({"model.weight": torch.zeros(4, 3)}, other)
    assert "key_prefix" not in str(info.value)
    fc = nn.Sequential()
    fc.fc = nn.Linear(1, 1)
    assert suggest_key_prefix(["a.x", "b.y"], ["a.x", "b.y"], fc) is None
    saved = ["model.module.fc.weight", "model.module.fc.bias"]
    assert suggest_key_prefix(saved, saved, fc) == "model."
