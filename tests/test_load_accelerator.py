"""Files from anywhere land on the rank's device: load_checkpoint, rank_map_location and resume on local rank 1.

Three files hold the same state: one saved from device 0 (``sim:0`` or ``cuda:0``, what every file written by
rank 0 is), the same tagged ``cuda:0`` (written on a GPU; on the test accelerator, a checkpoint from another
accelerator) and the same on the CPU. Each one, read by the process of local rank 1, must put every tensor on
device 1 and nothing on device 0. One body for the test accelerator and CUDA (the ``accelerator`` fixture).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dist_resume as dr
from dist_resume._core.tree import named_tensors
from dist_resume._layout.layout import Key
from tests.accelerator import Accel, on_accelerators
from tests.helpers import save_with_device_tag
from tests.models import TinyNet, assert_same, batches_on, make_batches, state_devices, train_steps

CPU = torch.device("cpu")
BATCHES = make_batches(3)
FILES = ("device0", "cuda0_tag", "cpu")
RANK1 = {"RANK": 1, "LOCAL_RANK": 1, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2}  # the second process of one node


@dataclass
class Saved:
    """The three files and the state they hold, as CPU tensors."""

    paths: dict[str, Path]
    state: dict[str, Any]
    base0: int  # bytes on device 0 once the run that wrote them is gone


def _ema(model: nn.Module, device: torch.device) -> AveragedModel:
    # device=: n_averaged is made there too (without it torch keeps that counter on the CPU)
    return AveragedModel(model, device=device, multi_avg_fn=get_ema_multi_avg_fn(0.9))


def _objects(accelerator: Accel, index: int, seed: int) -> tuple[nn.Module, Any, Any, AveragedModel]:
    """Model, Adam, GradScaler and EMA on device ``index``, built in the right order."""
    model = TinyNet(seed=seed).to(accelerator.device(index))
    return (
        model,
        torch.optim.Adam(model.parameters(), lr=1e-2),
        torch.amp.GradScaler(accelerator.type, init_scale=2.0**10, growth_interval=1),
        _ema(model, accelerator.device(index)),
    )


def _train(model: nn.Module, opt: Any, scaler: Any, ema: AveragedModel, batches: list[Any]) -> None:
    for batch in batches:
        train_steps(model, opt, [batch], scaler=scaler)
        ema.update_parameters(model)


def _resume(path: Path, model: nn.Module, optimizer: Any, scaler: Any, ema: nn.Module) -> dr.ResumeResult:
    """The one call into resume (kept in one place for the API reshape)."""
    return dr.resume(path, model=model, optimizer=optimizer, scaler=scaler, ema=ema)


def _tags(path: Path) -> set[str]:
    found: set[str] = set()

    def record(storage: Any, location: str) -> Any:
        found.add(location)
        return storage  # read onto the CPU: only the tags are wanted

    torch.load(path, map_location=record, weights_only=True)
    return found


@pytest.fixture
def saved(accelerator: Accel, tmp_path: Path) -> Iterator[Saved]:
    model, opt, scaler, ema = _objects(accelerator, 0, seed=0)
    _train(model, opt, scaler, ema, batches_on(BATCHES[:2], accelerator.device(0)))
    paths = {name: tmp_path / f"{name}.pt" for name in FILES}
    dr.save_checkpoint(paths["device0"], model=model, optimizer=opt, scaler=scaler, ema=ema, step=2)
    state = torch.load(paths["device0"], map_location="cpu", weights_only=True)
    torch.save(state, paths["cpu"])
    save_with_device_tag(state, paths["cuda0_tag"], tag="cuda:0")
    assert _tags(paths["device0"]) == {"cpu", f"{accelerator.type}:0"}  # the optimizer's step is a CPU scalar
    assert _tags(paths["cuda0_tag"]) == {"cuda:0"} and _tags(paths["cpu"]) == {"cpu"}
    del model, opt, scaler, ema  # freed by reference counting
    accelerator.synchronize()
    base0 = accelerator.memory_allocated(0)
    if base0:  # an earlier test's exception traceback (a reference cycle) can still hold device tensors
        gc.collect()  # only then: 0.3-1 s with torch loaded
        base0 = accelerator.memory_allocated(0)
    if accelerator.type == "sim":  # exact counters and no hidden allocations (cuBLAS keeps a workspace on cuda:0)
        assert base0 == 0
    accelerator.reset_peak_memory_stats(0)  # the tests check the peak: not even for a moment on device 0
    yield Saved(paths, state, base0)


@pytest.mark.parametrize("name", FILES)
@on_accelerators(2)
def test_resume_on_local_rank_1_puts_everything_on_device_1(
    accelerator: Accel, saved: Saved, env: Callable[..., None], name: str
) -> None:
    env(**RANK1)
    d1 = accelerator.device(1)
    assert dr.rank_device() == d1
    model, opt, scaler, ema = _objects(accelerator, 1, seed=5)
    result = _resume(saved.paths[name], model, opt, scaler, ema)
    assert result.step == 2 and set(result.restored) >= {"model", "optimizer", "scaler", "ema"}
    assert accelerator.memory_allocated(0) == saved.base0  # nothing landed on device 0

    state = saved.state
    assert_same(model.state_dict(), {k: v.to(d1) for k, v in state[Key.MODEL].items()})
    for i, p in enumerate(model.parameters()):
        restored, want = opt.state[p], state[Key.OPTIMIZER]["state"][i]
        assert restored.keys() == want.keys()
        for key, value in want.items():
            place = CPU if key == "step" else d1  # torch's policy: a plain Adam's step is a CPU scalar
            assert_same(restored[key], value.to(place))
    dr.check_devices(model, opt)
    assert scaler.state_dict() == state[Key.SCALER]
    assert scaler.scale(torch.ones((), device=d1)).item() == state[Key.SCALER]["scale"]
    ema_state = ema.state_dict()
    assert {t.device for t in ema_state.values()} == {d1}
    for key, value in state[Key.EMA].items():
        assert torch.equal(ema_state["n_averaged" if key == "n_averaged" else f"module.{key}"].cpu(), value), key

    # training goes on, on device 1 alone
    _train(model, opt, scaler, ema, batches_on(BATCHES[2:], d1))
    assert state_devices(opt, "exp_avg") == {d1} and state_devices(opt, "step") == {CPU}
    accelerator.synchronize()
    assert accelerator.memory_allocated(0) == accelerator.max_memory_allocated(0) == saved.base0


@pytest.mark.parametrize("name", FILES)
@on_accelerators(2)
def test_load_checkpoint_lands_every_storage_on_the_ranks_device(
    accelerator: Accel, saved: Saved, env: Callable[..., None], name: str
) -> None:
    path = saved.paths[name]
    nbytes = sum(t.nbytes for _, t in named_tensors(saved.state))

    def devices(obj: Any) -> set[str]:
        return {str(t.device) for _, t in named_tensors(obj)}

    env(**RANK1)
    d1 = accelerator.device(1)
    assert dr.rank_map_location() == d1 and dr.rank_map_location(1) == d1
    base1 = accelerator.memory_allocated(1)
    for load in (
        lambda: dr.load_checkpoint(path),  # the default follows LOCAL_RANK
        lambda: dr.load_checkpoint(path, mmap=False),
        lambda: dr.load_checkpoint(path, map_location=dr.rank_map_location(1)),
        lambda: torch.load(path, map_location=dr.rank_map_location(), weights_only=True),
    ):
        loaded = load()
        assert devices(loaded) == {str(d1)}  # the CPU-tagged step scalars too: every storage
        assert_same(loaded[Key.MODEL], {k: v.to(d1) for k, v in saved.state[Key.MODEL].items()})
        accelerator.synchronize()
        assert accelerator.memory_allocated(0) == saved.base0
        assert accelerator.memory_allocated(1) - base1 >= nbytes
        del loaded  # freed by reference counting: the next load starts from base1 again
        assert accelerator.memory_allocated(1) == base1
    assert accelerator.max_memory_allocated(0) == saved.base0
    env(RANK=0, LOCAL_RANK=0)  # local rank 0: device 0, whatever the file's tag
    assert devices(dr.load_checkpoint(path)) == {str(accelerator.device(0))}
    assert devices(dr.load_checkpoint(path, map_location="cpu")) == {"cpu"}


@on_accelerators(2)
def test_without_a_map_location_every_rank_piles_onto_device_0(accelerator: Accel, tmp_path: Path) -> None:
    """What rank_map_location prevents: plain torch.load restores a device-0 file onto device 0 on every rank."""
    path = tmp_path / "device0.pt"
    torch.save(TinyNet().to(accelerator.device(0)).state_dict(), path)
    before = accelerator.memory_allocated(0)
    with torch.accelerator.device_index(1):  # the process of local rank 1, its own device current
        plain = torch.load(path, weights_only=True)
    assert {t.device for t in plain.values()} == {accelerator.device(0)}
    assert accelerator.memory_allocated(0) - before >= sum(t.nbytes for t in plain.values())
