"""The benchmark's model, its Adam state, and the checkpoint built from them (for scripts/bench.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ModelSpec", "spec_for", "build_model", "give_adam_state", "state_bytes", "make_checkpoint"]


@dataclass(frozen=True)
class ModelSpec:
    """An embedding, ``blocks`` x (LayerNorm, Linear(d, 4d), Linear(4d, d)), a final LayerNorm; fp32."""

    d: int
    blocks: int
    vocab: int

    @property
    def params(self) -> int:
        block = 8 * self.d * self.d + 4 * self.d + self.d + 2 * self.d
        return self.vocab * self.d + self.blocks * block + 2 * self.d


def spec_for(checkpoint_bytes: int) -> ModelSpec:
    """A model whose fp32 weights plus Adam's exp_avg and exp_avg_sq come to about ``checkpoint_bytes``.

    At 1 GiB the large tensors are 36-56 MiB each: above glibc's 32 MiB ceiling for its dynamic
    mmap threshold, so every one of them is returned to the kernel when freed and RssAnon tells
    the truth about what is alive.
    """
    target = checkpoint_bytes / 12  # 4 bytes x (weight, exp_avg, exp_avg_sq) per parameter
    d = 1536 if checkpoint_bytes >= 2**29 else 512
    block = 8 * d * d + 7 * d
    blocks = max(1, math.floor(0.85 * target / block))
    vocab = max(1, round((target - blocks * block - 2 * d) / d))
    return ModelSpec(d=d, blocks=blocks, vocab=vocab)


def build_model(spec: ModelSpec, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Embedding(spec.vocab, spec.d)]
    for _ in range(spec.blocks):
        layers += [nn.LayerNorm(spec.d), nn.Linear(spec.d, 4 * spec.d), nn.Linear(4 * spec.d, spec.d)]
    layers.append(nn.LayerNorm(spec.d))
    return nn.Sequential(*layers)


def give_adam_state(model: nn.Module, opt: torch.optim.Optimizer, value: float = 1e-3) -> None:
    """One Adam step on constant gradients: exp_avg, exp_avg_sq and step exist, as mid-training."""
    for p in model.parameters():
        p.grad = torch.full_like(p, value)
    opt.step()
    for p in model.parameters():
        p.grad = None


def state_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held by the parameters and by each kind of optimizer state."""
    out = {"params": sum(p.numel() * p.element_size() for p in model.parameters())}
    for state in opt.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[key] = out.get(key, 0) + value.numel() * value.element_size()
    return out


def make_checkpoint(rank: int, world_size: int, path: str, spec: ModelSpec) -> dict[str, Any]:
    """Process body: build the model and its Adam state, save them with dist_resume; say how the bytes split."""
    import os

    import dist_resume

    model = build_model(spec, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    give_adam_state(model, opt)
    dist_resume.save_checkpoint(path, model=model, optimizer=opt, step=1, rng=False)
    split = state_bytes(model, opt)
    return {
        "file_bytes": os.path.getsize(path),
        "split": split,
        "tensors": 4 * len(list(model.parameters())),
        "params": sum(p.numel() for p in model.parameters()),
        "largest_tensor_bytes": max(p.numel() * 4 for p in model.parameters()),
    }
