"""RNG per accelerator on a real device: the rank's own device stream saved and restored, never another device's;
a checkpoint from another device type restores the CPU and Python streams and says so once.

One body for the test accelerator and CUDA (the ``accelerator`` fixture).
"""

from __future__ import annotations

import io
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._layout.layout import Key
from tests.accelerator import Accel, on_accelerators
from tests.helpers import save_with_device_tag
from tests.models import TinyNet


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded: dict[str, Any] = torch.load(buf, weights_only=True)
    return loaded


def _draw(device: torch.device) -> tuple[list[float], list[float], float]:
    """The next numbers of ``device``'s stream, the CPU stream and Python's."""
    return torch.rand(4, device=device).cpu().tolist(), torch.rand(4).tolist(), random.random()


@on_accelerators(2)
def test_the_ranks_own_device_stream_is_saved_and_restored_and_no_other(accelerator: Accel) -> None:
    d1 = accelerator.device(1)
    module = accelerator.module
    stream0 = module.get_rng_state(0)
    dr.seed_rng(1, rank=1, device=d1)
    assert torch.equal(module.get_rng_state(0), stream0)  # device 1 seeded alone
    state = _roundtrip(dr.rng_state_dict(d1))  # through torch.save/load(weights_only=True)
    assert state["device"]["type"] == accelerator.type
    assert torch.equal(state["device"]["state"], module.get_rng_state(1))
    expected = _draw(d1)
    _draw(d1)
    torch.rand(4, device=accelerator.device(0))  # device 0's stream moves on too
    stream0 = module.get_rng_state(0)
    dr.load_rng_state_dict(state, d1)
    assert _draw(d1) == expected
    assert torch.equal(module.get_rng_state(0), stream0)  # device 0 is left alone


def test_a_checkpoint_from_another_device_type_restores_the_cpu_streams_and_warns_once(
    accelerator: Accel, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    device = accelerator.device(0)
    other = "xpu" if accelerator.type == "cuda" else "cuda"  # a file written on another accelerator
    model = TinyNet().to(device)
    dr.seed_rng(7, rank=0, device=device)
    path = dr.save_checkpoint(tmp_path / "ckpt.pt", model=model, rng=True)
    saved = torch.load(path, map_location="cpu", weights_only=True)
    assert saved[Key.RNG][0]["device"]["type"] == accelerator.type
    saved[Key.RNG][0]["device"]["type"] = other
    save_with_device_tag(saved, path, tag=f"{other}:0")
    expected = _draw(device)
    _draw(device)
    stream = accelerator.module.get_rng_state(device.index)
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        result = dr.resume(path, model=model)  # rng=True is the default
    assert "rng" in result.restored
    got = _draw(device)
    assert got[1:] == expected[1:]  # the CPU and Python streams continue as saved
    assert got[0] != expected[0]  # the device stream was not touched: it went on from where it was
    accelerator.module.set_rng_state(stream, device.index)
    assert _draw(device)[0] == got[0]
    warned = [r.getMessage() for r in caplog.records if "not restored" in r.getMessage()]
    assert warned == [
        f"the saved {other} RNG stream is not restored: this process runs on {device} "
        "(the CPU, Python and numpy streams are restored)"
    ]
