"""What resume, prefix adaptation and async save copy, alias and keep (no timing: that is scripts/bench.py)."""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from dist_resume._core.tree import iter_tensors
from dist_resume._layout.layout import Key
from dist_resume._save import async_save as _async
from tests.models import TinyNet, assert_same, compile_module, make_batches, single_rank_group, train_steps

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads Linux /proc/self/maps")

KEYS = 12_000


def _mapped_ranges(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process mapped from ``path``."""
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            if line.rstrip().endswith(str(path)):
                start, end = line.split()[0].split("-")
                ranges.append((int(start, 16), int(end, 16)))
    return ranges


def _extents(tensors: Iterator[torch.Tensor]) -> list[tuple[int, int]]:
    """Byte ranges of the storages behind ``tensors`` (empty storages have none)."""
    out = []
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            out.append((s.data_ptr(), s.data_ptr() + s.nbytes()))
    return out


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return [x for x in a if any(x[0] < y[1] and y[0] < x[1] for y in b)]


def _trained_checkpoint(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    net = TinyNet(seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, make_batches(3))
    path = tmp_path / "ckpt.pt"
    dr.save_checkpoint(path, model=net, optimizer=opt, step=3)
    return path, torch.load(path, weights_only=True, mmap=False)


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("warm", [False, True], ids=["fresh_optimizer", "optimizer_with_state"])
@pytest.mark.parametrize("kind", ["plain", "ddp"])
def test_resume_writes_into_the_existing_tensors_and_keeps_nothing_of_the_file(tmp_path, kind, warm):
    path, saved = _trained_checkpoint(tmp_path)
    net = TinyNet(seed=1)
    group = single_rank_group(tmp_path) if kind == "ddp" else contextlib.nullcontext()
    with group:
        model = DDP(net) if kind == "ddp" else net
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if warm:
            train_steps(model, opt, make_batches(1, seed=9))
        before = {k: (v, v.data_ptr()) for k, v in net.state_dict(keep_vars=True).items()}
        live_state = {(id(p), key): (v, v.data_ptr()) for p, st in opt.state.items() for key, v in st.items()}
        dr.resume(path, model=model, optimizer=opt, options=dr.ResumeOptions(mmap=True))
        gc.collect()
        after = net.state_dict(keep_vars=True)
        for key, (tensor, ptr) in before.items():  # parameters and buffers: same objects, same memory
            assert after[key] is tensor and tensor.data_ptr() == ptr, key
        for (pid, key), (tensor, ptr) in live_state.items():  # existing optimizer state is written in place
            (state,) = [st for p, st in opt.state.items() if id(p) == pid]
            assert state[key] is tensor and tensor.data_ptr() == ptr, key
        assert len(live_state) == (3 * len(list(net.parameters())) if warm else 0)
        assert_same({k: v.detach() for k, v in after.items()}, saved[Key.MODEL])
        assert_same(opt.state_dict()["state"], saved[Key.OPTIMIZER]["state"])
        # nothing aliases the mapped checkpoint: with any state tensor in it, the mapping would still be there
        assert _mapped_ranges(path) == []
        state = list(iter_tensors([dict(s) for s in opt.state.values()]))
        assert len(state) == 3 * len(list(net.parameters()))  # step, exp_avg, exp_avg_sq each
        with torch.no_grad():  # the live state is private: changing it leaves the file alone
            for t in state:
                t.add_(1000)
    assert_same(torch.load(path, weights_only=True)[Key.OPTIMIZER]["state"], saved[Key.OPTIMIZER]["state"])
    held = dr.load_checkpoint(path, mmap=True)  # control: a live mapping is seen, under this very path
    assert _mapped_ranges(path) and _overlap(_extents(iter_tensors(held)), _mapped_ranges(path))


# ---------------------------------------------------------------- prefixes


class _Wide(nn.Module):
    """``KEYS`` state-dict entries: 60 blocks of 200 small buffers, and one parameter (DDP needs one)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.blocks = nn.ModuleList(nn.Module() for _ in range(KEYS // 200))
        for i, block in enumerate(self.blocks):
            for j in range(200):
                block.register_buffer(f"b{j}", torch.full((2,), float(i * 200 + j)))


def _assert_no_copy(out: Any, src: Any, rename: Any, expected_keys: list[str]) -> None:
    assert list(out) == expected_keys
    for key, value in out.items():
        original = src[rename(key)]
        assert value is original and value.data_ptr() == original.data_ptr(), key


def test_prefix_adaptation_hands_back_the_input_tensors_at_12k_keys(tmp_path):
    net = _Wide()
    plain = net.state_dict()
    assert len(plain) == KEYS + 1
    with single_rank_group(tmp_path):
        ddp = DDP(net)
        wrapped = ddp.state_dict()
        ddp_keys, plain_keys = list(wrapped), list(plain)
        compiled = compile_module(net)  # an OptimizedModule: "_orig_mod." keys, nothing compiled yet
        _assert_no_copy(dr.adapt_state_dict(plain, ddp), plain, lambda k: k[len("module.") :], ddp_keys)
        _assert_no_copy(dr.adapt_state_dict(wrapped, net), wrapped, lambda k: "module." + k, plain_keys)
        _assert_no_copy(
            dr.adapt_state_dict(plain, compiled), plain, lambda k: k[len("_orig_mod.") :], list(compiled.state_dict())
        )
        _assert_no_copy(dr.strip_prefix(wrapped), wrapped, lambda k: "module." + k, plain_keys)
        _assert_no_copy(dr.add_prefix(plain), plain, lambda k: k[len("module.") :], ddp_keys)


# ---------------------------------------------------------------- async save


@pytest.fixture
def gated_async_save(monkeypatch):
    """Hold every background write until the test opens the gate; record each snapshot taken."""
    gate, snapshots = threading.Event(), []
    real_snapshot, real_write = _async.stage, _async.atomic_write  # type: ignore[attr-defined]  # patched below

    def snapshot(obj: Any) -> Any:
        copied, queued = real_snapshot(obj)
        snapshots.append(copied)
        return copied, queued

    def write(dest: Any, fn: Any) -> Any:
        if not gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        return real_write(dest, fn)

    monkeypatch.setattr(_async, "stage", snapshot)
    monkeypatch.setattr(_async, "atomic_write", write)
    try:
        yield gate, snapshots
    finally:
        gate.set()  # never leave the (non-daemon) writer thread waiting
        with contextlib.suppress(dr.errors.CheckpointWriteError):
            _async.wait_pending()


def test_async_snapshot_is_private_before_the_write_starts(tmp_path, gated_async_save):
    gate, snapshots = gated_async_save
    net = TinyNet(seed=0)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    train_steps(net, opt, make_batches(2))
    at_call = {
        "model": {k: v.clone() for k, v in net.state_dict().items()},
        "state": copy.deepcopy(opt.state_dict()["state"]),
    }
    handle = dr.save_checkpoint_async(tmp_path / "a.pt", model=net, optimizer=opt, step=2)
    assert not handle.done()  # the write has not started: whatever follows happens before it
    live = list(iter_tensors(net.state_dict())) + list(iter_tensors([dict(s) for s in opt.state.values()]))
    assert len(snapshots) == 1 and len(list(iter_tensors(snapshots[0]))) >= len(live)
    assert _overlap(_extents(iter_tensors(snapshots[0])), _extents(iter(live))) == []
    with torch.no_grad():  # training goes on in place
        for t in live:
            t.add_(1)
    gate.set()
    handle.wait()
    saved = torch.load(tmp_path / "a.pt", weights_only=True)
    assert_same(saved[Key.MODEL], at_call["model"])
    assert_same(saved[Key.OPTIMIZER]["state"], at_call["state"])
    assert not torch.equal(net.fc.weight, at_call["model"]["fc.weight"])
