"""Async save from accelerator tensors: the file holds the values at the call even though training changes them at
once, and the host copies were staged in pinned memory (both backends pin: CUDA, and the test accelerator's hooks).

One body for the test accelerator and CUDA (the ``accelerator`` fixture).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._core.tree import iter_tensors
from dist_resume._layout.layout import Key
from dist_resume._save import staging
from tests.accelerator import Accel
from tests.models import TinyNet, assert_same, batches_on, make_batches, train_steps

BATCHES = make_batches(4)


def test_async_save_of_device_tensors_holds_the_values_at_the_call(
    accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    device = accelerator.device(0)
    net = TinyNet().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    train_steps(net, opt, batches_on(BATCHES[:2], device))
    at_call = {k: v.to("cpu", copy=True) for k, v in net.state_dict().items()}
    opt_at_call = {i: {k: v.to("cpu", copy=True) for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    n_device = len(at_call) + sum(t.device == device for t in iter_tensors(opt.state_dict()["state"]))
    asked: list[tuple[str, bool]] = []
    real = staging.pinned_staging  # type: ignore[attr-defined]  # the name staging imported (patched below)

    def recording(device_type: str) -> bool:
        answer = real(device_type)
        asked.append((device_type, answer))
        return answer

    monkeypatch.setattr(staging, "pinned_staging", recording)
    handle = dr.save_checkpoint_async(tmp_path / "ckpt.pt", model=net, optimizer=opt, step=2)
    with torch.no_grad():  # training goes on at once, in place: parameters and optimizer state
        for p in net.parameters():
            p.add_(1.0)
    train_steps(net, opt, batches_on(BATCHES[2:], device))
    assert handle.wait() == tmp_path / "ckpt.pt"

    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # staged on the host: every storage tagged cpu
    assert_same(saved[Key.MODEL], at_call)
    assert_same(saved[Key.OPTIMIZER]["state"], opt_at_call)
    # asked for device tensors only, and the backend pins: each device tensor went through pinned memory, no CPU one
    assert asked and set(asked) == {(accelerator.type, True)} and len(asked) == n_device
    assert sum(t.is_pinned() for t in staging._buffers) == n_device
