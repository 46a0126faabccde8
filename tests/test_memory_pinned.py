"""A snapshot's copies from the accelerator through page-locked memory (dist_resume._manager.snapshots.pinned): the slot's
mapping registered where the accelerator can (CUDA), else pinned staging buffers (the test accelerator), else the
direct copy; the same bytes each way, and a resume that is bitwise.

The staging test has one body for the test accelerator (every run) and CUDA (the ``accelerator`` fixture's ``cuda``
variant, the multi-GPU job; its registration switched off there). The registration's bookkeeping is followed on the
test accelerator with ``register_host`` answering yes; a real ``cudaHostRegister`` of a slot's mapping is CUDA's alone
(marked ``cuda``: skipped without a GPU). The hook that unregisters a mapping before it is dropped is torch-free
(dist_resume._shm.slots) and runs anywhere.
"""

from __future__ import annotations

import logging
import mmap
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._dist import accelerator as acc
from dist_resume._format import tensor_records
from dist_resume._manager.snapshots import pinned
from dist_resume._save import save as save_module
from dist_resume._shm import place, slots
from tests.accelerator import Accel, on_accelerators
from tests.helpers import fake_accelerator

STAGED = 512  # bytes per staging buffer here: every parameter below takes several chunks


@pytest.fixture(autouse=True)
def shm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's snapshots in a shared-memory directory of its own."""
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    return tmp_path / "shm"


def _holds(path: Path, model: torch.nn.Module, extra: dict[str, torch.Tensor]) -> bool:
    """Whether the torch file ``path`` holds ``model``'s state and ``extra``, bitwise."""
    loaded = torch.load(path, weights_only=True, map_location="cpu")
    expected = [(loaded["model"], model.state_dict()), (loaded["extra"], extra)]
    return all(torch.equal(got[k], v.cpu()) for got, want in expected for k, v in want.items())


def _trained(device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, torch.Tensor]]:
    """A model and its AdamW state on ``device`` after one step, and extra tensors of each shape the staging meets."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Linear(16, 8)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 24, device=device)).sum().backward()
    opt.step()
    extra = {
        "bf16": torch.randn(700, device=device).to(torch.bfloat16),  # 1400 bytes: three chunks
        "rows": torch.randn(40, 30, device=device).t(),  # not contiguous: chunks of whole 160-byte rows
        "wide": torch.randn(200, 3, device=device).t(),  # not contiguous, 800-byte rows: copied directly
    }
    return model, opt, extra


def _snapshot(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, extra: dict[str, Any]) -> bytes:
    """The bytes of a snapshot of step 1 into the folder ``root``, which keeps it for a restart (as a crash would)."""
    with pytest.raises(RuntimeError, match="preempted"), dr.CheckpointManager(root, model=model) as mgr:
        mgr.snapshot(1, optimizer=opt, extra=extra)
        mgr._memory._join_commit(raising=True)
        newest = mgr._memory.newest
        assert newest is not None
        data = newest.path.read_bytes()
        raise RuntimeError("preempted")  # the snapshots stay for the restart
    return data


def _same_stamps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every file saved from here on stamped alike: its ``saved_at`` and its zip's ``serialization_id``."""
    monkeypatch.setattr(save_module, "time", types.SimpleNamespace(time=lambda: 1.7e9, perf_counter=time.perf_counter))
    monkeypatch.setattr(tensor_records, "secrets", types.SimpleNamespace(randbits=lambda bits: 12345))


def _landed(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """The pinned chunks copied into a mapping from here on (each still a view of its staging buffer)."""
    seen: list[torch.Tensor] = []
    real = pinned._land

    def recording(chunk: Any) -> None:
        seen.append(chunk.staged)
        real(chunk)

    monkeypatch.setattr(pinned, "_land", recording)
    return seen


@on_accelerators(2)
def test_a_snapshot_from_the_accelerator_goes_through_pinned_staging_the_same_bytes_and_resumes_bitwise(
    accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "STAGING_BYTES", STAGED)
    monkeypatch.setattr(pinned, "register_host", lambda *args: False)  # CUDA would register the mapping instead
    device = accelerator.device(1)  # not the current device: each chunk waits on its own device's stream
    model, opt, extra = _trained(device)
    on_device = [t for t in [*model.state_dict().values(), *extra.values()] if t.device == device]
    on_device += [t for s in opt.state.values() for t in s.values() if t.device == device]
    assert len(on_device) == 4 * 3 + 3  # weights, biases, both moments of each; the three extras

    _same_stamps(monkeypatch)
    landed = _landed(monkeypatch)
    staged = _snapshot(tmp_path / "staged", model, opt, extra)
    assert landed and all(chunk.is_pinned() for chunk in landed)
    assert max(chunk.nbytes for chunk in landed) <= STAGED and len(landed) > len(on_device)  # the large ones chunked
    assert sum(chunk.nbytes for chunk in landed) == sum(t.nbytes for t in on_device) - extra["wide"].nbytes
    buffers = {chunk.untyped_storage().data_ptr() for chunk in landed}
    assert len(buffers) == 2  # two buffers, reused for every chunk of every tensor

    landed.clear()
    monkeypatch.setattr(pinned, "STAGING_BYTES", 0)  # staging off: every tensor copied directly, as before
    direct = _snapshot(tmp_path / "direct", model, opt, extra)
    assert landed == [] and staged == direct

    fresh = torch.nn.Sequential(torch.nn.Linear(24, 16), torch.nn.Linear(16, 8)).to(device)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    with dr.CheckpointManager(tmp_path / "staged", model=fresh, optimizer=fresh_opt) as again:
        result = again.resume()
    assert result is not None and (result.step, result.source) == (1, "memory")
    for mine, theirs in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True):
        assert mine.device == device and torch.equal(mine.cpu(), theirs.cpu())
    for mine_state, theirs_state in zip(fresh_opt.state.values(), opt.state.values(), strict=True):
        for key, value in theirs_state.items():
            assert torch.equal(mine_state[key].cpu(), value.cpu()), key
    for key, value in extra.items():
        assert torch.equal(result.extra[key].cpu(), value.cpu()), key


def test_a_registered_mapping_is_registered_once_copied_into_without_blocking_and_unregistered_when_dropped(
    sim_accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    registered: list[tuple[int, int, str]] = []
    unregistered: list[tuple[int, str]] = []
    synced: list[list[torch.device]] = []

    def register(address: int, nbytes: int, device_type: str) -> bool:
        registered.append((address, nbytes, device_type))
        return True  # the test accelerator cannot page-lock memory: here it says it did, to follow the mapping

    def unregister(address: int, device_type: str) -> None:
        unregistered.append((address, device_type))

    def synchronizing(devices: Any) -> None:
        synced.append(list(devices))
        acc.synchronize(synced[-1])

    monkeypatch.setattr(pinned, "register_host", register)
    monkeypatch.setattr(pinned, "unregister_host", unregister)
    monkeypatch.setattr(pinned, "synchronize", synchronizing)
    landed = _landed(monkeypatch)
    device = sim_accelerator.device(1)
    model, opt, extra = _trained(device)
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt) as mgr:
        addresses, paths = [], []
        for step in (1, 2, 3):  # slots a, b, a
            synced.clear()
            mgr.snapshot(step, extra=extra)
            mgr._memory._join_commit(raising=True)
            newest = mgr._memory.newest
            assert newest is not None
            mm = slots.mapped(newest.path, newest.size)
            assert mm is not None
            addresses.append((torch.frombuffer(mm, dtype=torch.uint8).data_ptr(), newest.size))
            paths.append(newest.path)
            assert synced == [[device]]  # once, the devices copied from, before snapshot() returned
        assert [(a, n) for a, n, _ in registered] == addresses[:2] and {t for *_, t in registered} == {"sim"}
        assert addresses[2] == addresses[0] and unregistered == []  # slot a's mapping: registered once
        assert _holds(paths[-1], model, extra)
    assert landed == []  # nothing staged
    assert sorted(unregistered) == sorted((a, "sim") for a, _ in addresses[:2])  # close() dropped both mappings


def test_a_registration_refused_falls_back_to_staging(
    sim_accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "STAGING_BYTES", STAGED)
    asked: list[str] = []

    def refuse(address: int, nbytes: int, device_type: str) -> bool:
        asked.append(device_type)
        return False

    monkeypatch.setattr(pinned, "register_host", refuse)
    landed = _landed(monkeypatch)
    model, opt, extra = _trained(sim_accelerator.device(0))
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt) as mgr:
        for step in (1, 2, 3):
            mgr.snapshot(step, extra=extra)
    assert asked == ["sim", "sim"]  # once per mapping (slots a and b), never again for a refused one
    assert len(landed) > 3 * len(model.state_dict())


def test_a_copy_failing_midway_lets_go_of_the_staging_buffers(
    sim_accelerator: Accel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pinned, "STAGING_BYTES", STAGED)
    device = sim_accelerator.device(1)
    model, opt, extra = _trained(device)
    real, synced, calls = pinned._land, [], []

    def failing(chunk: Any) -> None:
        calls.append(chunk)
        if len(calls) == 3:
            raise RuntimeError("the copy failed")  # in the copy of a chunk into the mapping
        real(chunk)

    monkeypatch.setattr(pinned, "_land", failing)
    monkeypatch.setattr(pinned, "synchronize", lambda devices: synced.append(list(devices)))
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt) as mgr:
        with pytest.raises(RuntimeError, match="the copy failed"):
            mgr.snapshot(1, extra=extra)
        assert synced == [[device]]  # the chunk still copying into the other buffer was waited for
        assert not pinned._buffers_lock.locked()
        mgr.snapshot(2, extra=extra)  # the buffers are free for the next snapshot
        mgr._memory._join_commit(raising=True)
        newest = mgr._memory.newest
        assert newest is not None and newest.step == 2 and _holds(newest.path, model, extra)


@pytest.mark.cuda
def test_on_cuda_the_slots_mapping_is_registered_and_unregistered_when_dropped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _same_stamps(monkeypatch)
    landed = _landed(monkeypatch)
    device = torch.device("cuda", 0)
    model, opt, extra = _trained(device)
    with dr.CheckpointManager(tmp_path / "run", model=model, optimizer=opt) as mgr:
        mgr.snapshot(1, extra=extra)
        mgr._memory._join_commit(raising=True)
        newest = mgr._memory.newest
        assert newest is not None
        mm = slots.mapped(newest.path, newest.size)
        assert mm is not None
        host = torch.frombuffer(mm, dtype=torch.uint8)
        assert pinned._registered[id(mm)] == host.data_ptr() and host.is_pinned()  # page-locked by cudaHostRegister
        del host
        registered = newest.path.read_bytes()
    assert landed == [] and id(mm) not in pinned._registered  # nothing staged; close() unregistered it

    monkeypatch.setattr(pinned, "register_host", lambda *args: False)
    monkeypatch.setattr(pinned, "STAGING_BYTES", 0)  # the copy as it was: straight into pageable memory
    assert _snapshot(tmp_path / "direct", model, opt, extra) == registered


def test_register_host_calls_cudas_runtime_and_a_refusal_is_one_debug_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[tuple[Any, ...]] = []
    answers = {"register": 0, "unregister": 0}

    def register(address: int, nbytes: int, flags: int) -> int:
        calls.append(("register", address, nbytes, flags))
        return answers["register"]

    def unregister(address: int) -> int:
        calls.append(("unregister", address))
        return answers["unregister"]

    runtime = types.SimpleNamespace(cudaHostRegister=register, cudaHostUnregister=unregister)
    monkeypatch.setattr(acc, "_cudart", lambda: runtime)
    cleared: list[str] = []
    monkeypatch.setattr(acc, "_clear_error", cleared.append)
    monkeypatch.setattr(acc, "_pins", lambda device_type: True)
    fake_accelerator(monkeypatch, "xpu", count=1)
    assert not acc.register_host(4096, 8192, "xpu") and calls == []  # no such call for xpu
    fake_accelerator(monkeypatch, "cuda", count=1)
    assert not acc.register_host(4096, 8192, "xpu") and calls == []  # not this process's accelerator
    caplog.set_level(logging.DEBUG, logger="dist_resume")
    assert acc.register_host(4096, 8192, "cuda")
    acc.unregister_host(4096, "cuda")
    assert calls == [("register", 4096, 8192, 1), ("unregister", 4096)] and cleared == [] and caplog.records == []
    answers.update(register=801, unregister=712)  # cudaErrorNotSupported, cudaErrorHostMemoryNotRegistered
    assert not acc.register_host(4096, 8192, "cuda")
    acc.unregister_host(4096, "cuda")
    assert cleared == ["cuda", "cuda"]  # the runtime's last error consumed, not left for torch's next kernel
    assert [r.levelno for r in caplog.records] == [logging.DEBUG] * 2
    assert "error 801" in caplog.records[0].getMessage() and "error 712" in caplog.records[1].getMessage()


def test_a_mappings_callbacks_run_once_before_it_is_dropped(tmp_path: Path) -> None:
    order: list[str] = []
    a, b = tmp_path / "state.a.pt", tmp_path / "state.b.pt"
    mm = slots.map_slot(a, 4096)

    def callback(name: str, mapping: mmap.mmap) -> Any:
        return lambda: order.append(f"{name}:{'closed' if mapping.closed else 'mapped'}")

    assert slots.when_unmapped(mm, callback("a1", mm)) and slots.when_unmapped(mm, callback("a2", mm))
    assert not slots.when_unmapped(mmap.mmap(-1, 4096), callback("anonymous", mm))  # not a kept mapping
    assert slots.map_slot(a, 4096) is mm and order == []  # kept across snapshots
    bigger = slots.map_slot(a, 8192)  # another size: the slot made anew, its old mapping dropped
    assert order == ["a1:mapped", "a2:mapped"] and mm.closed
    slots.when_unmapped(bigger, callback("a3", bigger))
    slots.forget(a)
    slots.forget(a)
    assert order[2:] == ["a3:mapped"]
    other = slots.map_slot(b, 4096)
    assert slots.when_unmapped(other, callback("b", other))
    b.unlink()  # removed (by the node's writer, had this process attached to it)
    slots.map_slot(a, 4096)
    slots.attach_slot(a, 4096)  # drops this process's stale mapping of b first
    assert order[3:] == ["b:mapped"]
    slots.forget_store(tmp_path)
