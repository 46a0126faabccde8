"""Self-tests of the test accelerator: each check fails if the simulation stops behaving as torch and CUDA do.

The ``accelerator`` fixture runs the device-generic tests on ``sim`` here and on ``cuda`` in the multi-GPU job;
where the two really differ (FACTS 28: ``Module.to`` keeps CUDA Parameters, not sim ones) the test says so.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume
from tests import accelerator as sim
from tests.accelerator import _build, ddp_worker
from tests.dist.harness import run_torchrun

SAME_DEVICE = "Expected all tensors to be on the same device"


def _same_device(a: torch.device, b: str | torch.device) -> str:
    return re.escape(f"{SAME_DEVICE}, but found at least two devices, {a} and {b}!")


@pytest.fixture
def sim_only() -> None:
    reason = sim.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def test_enabled_switches_the_accelerator_on_and_off(sim_only: None, tmp_path: Path, env: Callable[..., None]) -> None:
    saved = tmp_path / "on_sim.pt"
    with sim.enabled(2):
        assert torch.accelerator.is_available()
        assert torch.accelerator.current_accelerator(check_available=True) == torch.device("sim")
        assert torch.accelerator.device_count() == 2
        module = torch.get_device_module("sim")
        assert module.__name__ == "dist_resume._sim.device_module" and module.device_count() == 2
        assert torch.accelerator.current_device_index() == 0
        torch.accelerator.set_device_index(1)
        assert torch.accelerator.current_device_index() == 1 and module.current_device() == 1
        assert torch.empty(1, device="sim").device == torch.device("sim", 1)  # "sim" alone: the current device
        with torch.accelerator.device_index(0):
            assert torch.empty(1, device="sim").device == torch.device("sim", 0)
        with module.device(0):
            assert torch.accelerator.current_device_index() == 0
        assert torch.accelerator.current_device_index() == 1
        seen: list[int] = []  # the current device is per thread, as with cudaSetDevice
        thread = threading.Thread(target=lambda: seen.append(torch.accelerator.current_device_index()))
        thread.start()
        thread.join()
        assert seen == [0]
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.empty(1, device="sim:2")
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            torch.accelerator.set_device_index(5)
        torch.save({"w": torch.ones(2, device="sim:0")}, saved)
        with sim.enabled(1):  # nested: fewer devices, then back to 2
            assert torch.accelerator.device_count() == 1
            with pytest.raises(RuntimeError, match="invalid device ordinal"):
                torch.empty(1, device="sim:1")
        assert torch.accelerator.device_count() == 2
        assert torch.accelerator.current_device_index() == 1  # enabled() restored the device it found
    # off again: a CPU-only machine for torch's device-generic code and for dist_resume
    assert not torch.accelerator.is_available()
    assert torch.accelerator.device_count() == 0
    assert torch.accelerator.current_accelerator(check_available=True) is None
    assert torch.accelerator.current_accelerator() == torch.device("sim")  # as a CUDA build of torch on a CPU host
    with pytest.raises(RuntimeError, match="test accelerator is disabled"):
        torch.ones(1, device="sim:0")
    with pytest.raises(RuntimeError, match="cannot pin memory"):
        torch.ones(1).pin_memory()
    with pytest.raises(RuntimeError, match=r"on a SIM device but torch\.sim\.is_available\(\) is False"):
        torch.load(saved, weights_only=True)  # what a GPU checkpoint does on a CPU-only host
    assert torch.load(saved, map_location="cpu", weights_only=True)["w"].device == torch.device("cpu")
    env()
    assert dist_resume.rank_device() == torch.device("cpu")


@sim.on_accelerators(2)
def test_memory_is_counted_per_device(accelerator: sim.Accel) -> None:
    gc.collect()
    base0, base1 = accelerator.memory_allocated(0), accelerator.memory_allocated(1)
    t = torch.empty(256 * 1024, device=accelerator.device(1))  # 1 MiB, made while device 0 is current
    assert t.untyped_storage().device == accelerator.device(1)
    grown = accelerator.memory_allocated(1) - base1
    assert grown >= t.nbytes and accelerator.memory_allocated(0) == base0
    u = t.fill_(1.0) * 2  # a kernel's output lands on its inputs' device, not on the current one
    assert u.device == accelerator.device(1) and accelerator.memory_allocated(0) == base0
    assert accelerator.memory_allocated(1) - base1 >= 2 * t.nbytes
    other: list[torch.device] = []

    def add_one(source: torch.Tensor) -> None:  # another thread, whose current device is 0
        other.append((source + 1).device)

    worker = threading.Thread(target=add_one, args=(t,))
    worker.start()
    worker.join()
    assert other == [accelerator.device(1)] and accelerator.memory_allocated(0) == base0
    peak = accelerator.max_memory_allocated(1)
    assert peak >= base1 + 2 * t.nbytes
    if accelerator.type == "sim":  # no caching allocator: the counters are exact
        assert grown == t.nbytes
    del t, u
    gc.collect()
    assert accelerator.memory_allocated(1) == base1
    assert accelerator.max_memory_allocated(1) == peak
    accelerator.reset_peak_memory_stats(1)
    assert accelerator.max_memory_allocated(1) == base1


@sim.on_accelerators(2)
def test_values_and_copies_match_the_cpu(accelerator: sim.Accel) -> None:
    d0, d1 = accelerator.device(0), accelerator.device(1)
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    xs = x.to(d1)
    assert xs.device == d1 and torch.equal(xs.cpu(), x)
    assert torch.allclose((xs @ xs.T).cpu(), x @ x.T)
    assert torch.allclose(torch.softmax(xs, dim=1).cpu(), torch.softmax(x, dim=1))
    assert torch.equal((xs * 3 - 1).cpu(), x * 3 - 1) and xs.sum().item() == pytest.approx(x.sum().item(), rel=1e-6)
    assert torch.equal(xs.t().cpu(), x.t()) and torch.equal(x.t().to(d1).cpu(), x.t())  # strided both ways
    assert torch.equal(xs.to(torch.float64).cpu(), x.double()) and xs.half().dtype == torch.float16
    assert torch.equal(xs.to(d0).cpu(), x) and xs.to(d0).device == d0
    row = xs[1]  # a view shares storage: writing through it changes the base
    row.mul_(0)
    assert torch.equal(xs.cpu()[1], torch.zeros(7)) and torch.equal(xs.cpu()[0], x[0])
    pinned = x.pin_memory()
    assert pinned.is_pinned() and not x.is_pinned() and pinned.device.type == "cpu"
    assert torch.equal(pinned.to(d1, non_blocking=True).cpu(), x)
    accelerator.synchronize()
    cpu_state = torch.get_rng_state()
    torch.manual_seed(3)  # seeds every device's generator too
    a = torch.rand(4, device=d1)
    state0, state1 = accelerator.module.get_rng_state(0), accelerator.module.get_rng_state(1)
    b = torch.rand(4, device=d1)
    assert not torch.equal(a.cpu(), b.cpu())
    assert torch.equal(accelerator.module.get_rng_state(0), state0)  # device 0's generator was not drawn from
    assert not torch.equal(accelerator.module.get_rng_state(1), state1)
    accelerator.module.set_rng_state(state1, 1)
    assert torch.equal(torch.rand(4, device=d1).cpu(), b.cpu())  # the state restores the stream
    torch.set_rng_state(cpu_state)


@sim.on_accelerators(2)
def test_mixed_devices_are_refused_with_torchs_message(accelerator: sim.Accel) -> None:
    d0, d1 = accelerator.device(0), accelerator.device(1)
    a = torch.ones(3, device=d0)
    with pytest.raises(RuntimeError, match=_same_device(d0, "cpu")):
        a + torch.ones(3)
    with pytest.raises(RuntimeError, match=_same_device(d0, "cpu")):
        torch.ones(3) + a  # the accelerator is named first whichever side it is on
    with pytest.raises(RuntimeError, match=_same_device(d0, d1)):
        a + torch.ones(3, device=d1)
    with pytest.raises(RuntimeError, match=_same_device(d0, "cpu")):
        a.add_(torch.ones(3))
    assert torch.equal(a.cpu(), torch.ones(3))  # refused before anything was written
    with pytest.raises(RuntimeError, match=SAME_DEVICE):  # a foreach kernel, as in the optimizers
        torch._foreach_add_([torch.ones(3)], [a])
    with pytest.raises(RuntimeError, match=SAME_DEVICE):  # CUDA's mm words the rest differently (FACTS 29)
        torch.mm(a.view(1, 3), torch.ones(3, 1))
    scalar = torch.tensor(2.0)  # a 0-dim CPU tensor is a scalar: accepted, the result stays on the device
    assert (a + scalar).device == d0 and (scalar * a).device == d0
    assert torch.equal((scalar * a).cpu(), torch.full((3,), 2.0))


@sim.on_accelerators(2)
def test_save_tags_and_load_remaps(accelerator: sim.Accel, tmp_path: Path) -> None:
    kind, d0, d1 = accelerator.type, accelerator.device(0), accelerator.device(1)
    path = tmp_path / "ckpt.pt"
    w = torch.arange(6.0).reshape(2, 3)
    torch.save({"w": w.to(d0), "step": torch.tensor(3)}, path)
    tags: list[str] = []

    def record(storage: Any, location: str) -> Any:
        tags.append(location)
        return None  # None: torch restores to the saved location

    def to_d1(storage: Any, location: str) -> Any:
        return storage if location == "cpu" else storage.to(device=d1)

    assert torch.load(path, map_location=record, weights_only=True)["w"].device == d0
    assert sorted(tags) == ["cpu", f"{kind}:0"]
    gc.collect()
    before0 = accelerator.memory_allocated(0)
    loads = {
        "str": torch.load(path, map_location=f"{kind}:1", weights_only=True),
        "dict": torch.load(path, map_location={f"{kind}:0": f"{kind}:1"}, weights_only=True),
        "callable": torch.load(path, map_location=to_d1, weights_only=True),
        "mmap": torch.load(path, map_location=d1, weights_only=True, mmap=True),
    }
    for how, state in loads.items():
        assert state["w"].device == d1, how
        assert torch.equal(state["w"].cpu(), w), how
    assert loads["dict"]["step"].device == torch.device("cpu")  # a dict maps exact tags only (FACTS 3)
    assert loads["str"]["step"].device == d1
    assert accelerator.memory_allocated(0) == before0  # nothing landed on device 0


def test_module_to_creates_new_parameters_unless_swapped(accelerator: sim.Accel) -> None:
    device = accelerator.device(0)
    shallow = torch._has_compatible_shallow_copy_type(torch.empty(1), torch.empty(1, device=device))
    assert shallow == (accelerator.type == "cuda")  # torch's own rule for keeping Parameters in Module.to (FACTS 28)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    weight = model.weight
    opt = torch.optim.SGD(model.parameters(), lr=0.5)  # built before the move
    model.to(device)
    assert (model.weight is weight) == shallow
    before = model.weight.detach().clone()
    torch.autograd.backward(model(torch.ones(4, 3, device=device)).sum())
    opt.step()  # on sim: the optimizer steps the stale CPU Parameters, silently
    assert (not torch.equal(model.weight.detach(), before)) == shallow
    kept = torch.nn.Linear(3, 2)
    kept_weight = kept.weight
    with sim.swap_module_params():
        kept.to(device)
    assert kept.weight is kept_weight and kept_weight.device == device
    assert not torch.__future__.get_swap_module_params_on_conversion()


OPTIMIZERS: list[tuple[str, Callable[..., torch.optim.Optimizer]]] = [
    ("SGD(momentum=0.9)", lambda params, **kw: torch.optim.SGD(params, lr=0.1, momentum=0.9, **kw)),
    ("Adam", lambda params, **kw: torch.optim.Adam(params, lr=0.1, **kw)),
]


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device, steps: int = 1) -> None:
    for _ in range(steps):
        opt.zero_grad()
        torch.autograd.backward(model(torch.ones(2, 4, device=device)).pow(2).sum())
        opt.step()


def test_seed_bug_reproduces_in_the_wrong_order(accelerator: sim.Accel) -> None:
    device = accelerator.device(0)
    for name, make in OPTIMIZERS:
        for foreach in (True, False):
            case = f"{name} foreach={foreach}"
            torch.manual_seed(0)
            source = torch.nn.Linear(4, 3)
            source_opt = make(source.parameters(), foreach=foreach)
            _train(source, source_opt, torch.device("cpu"))
            model_sd = source.state_dict()
            opt_sd = copy.deepcopy(source_opt.state_dict())  # load_state_dict shares CPU tensors (FACTS 33)
            # wrong: optimizer state loaded while the parameters are on the CPU, the model moved afterwards
            wrong = torch.nn.Linear(4, 3)
            wrong_opt = make(wrong.parameters(), foreach=foreach)
            wrong.load_state_dict(model_sd)
            wrong_opt.load_state_dict(copy.deepcopy(opt_sd))
            with sim.swap_module_params():
                wrong.to(device)
            with pytest.raises(RuntimeError, match=_same_device(device, "cpu")):
                _train(wrong, wrong_opt, device)
            # right: model to the device, then the optimizer, then the loads
            right = torch.nn.Linear(4, 3).to(device)
            right_opt = make(right.parameters(), foreach=foreach)
            right.load_state_dict(model_sd)
            right_opt.load_state_dict(copy.deepcopy(opt_sd))
            state = right_opt.state[right.weight]
            placed = {k: v.device.type for k, v in state.items()}
            assert all(placed[k] == accelerator.type for k in placed if k != "step"), (case, placed)
            assert placed.get("step", "cpu") == "cpu", case  # not fused, not capturable: step stays on the CPU
            _train(right, right_opt, device)
            _train(source, source_opt, torch.device("cpu"))
            assert torch.allclose(right.weight.detach().cpu(), source.weight.detach(), atol=1e-6), case


@pytest.mark.parametrize(
    "options",
    [
        {"foreach": False},
        {"foreach": True},
        {"fused": True},
        {"capturable": True},
        {"capturable": True, "foreach": True},
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_optimizer_variants_step_on_the_accelerator(accelerator: sim.Accel, options: dict[str, Any]) -> None:
    device = accelerator.device(0)
    classes: list[tuple[Callable[..., torch.optim.Optimizer], dict[str, Any]]] = [
        (torch.optim.Adam, {}),
        (torch.optim.AdamW, {}),
        (torch.optim.SGD, {"momentum": 0.9}),
    ]
    for cls, extra in classes:
        if cls is torch.optim.SGD and "capturable" in options:
            continue  # SGD has no capturable mode
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3).to(device)
        opt = cls(model.parameters(), lr=0.1, **extra, **options)
        torch.manual_seed(0)
        ref = torch.nn.Linear(4, 3)
        ref_opt = cls(ref.parameters(), lr=0.1, **extra, foreach=False)
        _train(model, opt, device, steps=3)
        _train(ref, ref_opt, torch.device("cpu"), steps=3)
        assert torch.allclose(model.weight.detach().cpu(), ref.weight.detach(), atol=1e-5), (cls.__name__, options)
        state = opt.state[model.weight]
        assert all(v.device == device for k, v in state.items() if k != "step"), (cls.__name__, state)
        if "step" in state:  # fused and capturable keep step on the device (FACTS 2)
            on_device = bool(options.get("fused") or options.get("capturable"))
            assert (state["step"].device == device) == on_device, (cls.__name__, options)


def test_build_is_locked_and_reused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Two builders at once (as two xdist workers): one compiles, the other waits and reuses; a stale baton file of
    cpp_extension (a killed build) does not hang the next one."""
    missing = _build.toolchain_missing()
    if missing is not None:
        pytest.skip(missing)
    source = tmp_path / "tiny.cpp"
    source.write_text("int dist_resume_sim_tiny() { return 7; }\n")
    monkeypatch.setattr(_build, "SOURCE", source)
    monkeypatch.setenv(_build.CACHE_ENV, str(tmp_path / "root"))
    target = _build.library_path()
    assert target.parent.parent == tmp_path / "root"  # $DIST_RESUME_SIM_CACHE decides where builds go
    target.parent.mkdir(parents=True)
    (target.parent / "lock").write_text("")  # what a killed cpp_extension build leaves behind
    real_run = subprocess.run
    compiles: list[int] = []

    def counting_run(*args: Any, **kwargs: Any) -> Any:
        compiles.append(1)
        return real_run(*args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counting_run)  # the module _build calls
    errors: list[BaseException] = []

    def builder() -> None:
        try:
            _build._locked_build(target)
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=builder) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and target.is_file() and len(compiles) == 1
    assert _build.library_path() == target  # same source and torch: the same key
    source.write_text("int dist_resume_sim_tiny() { return 8; }\n")
    assert _build.library_path() != target  # a changed source builds afresh


@pytest.mark.slow
@pytest.mark.dist
def test_ddp_trains_on_sim_devices_under_torchrun(sim_worker_env: dict[str, str], tmp_path: Path) -> None:
    worker = Path(ddp_worker.__file__)
    proc = run_torchrun([str(worker), str(tmp_path)], nproc=2, cwd=tmp_path, env=sim_worker_env, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports = {rank: json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    # the single-process reference: the same model on the CPU, the two ranks' batches as one
    model = ddp_worker.make_model()
    opt = torch.optim.SGD(model.parameters(), lr=ddp_worker.LR)
    for step in range(ddp_worker.STEPS):
        xs, ys = zip(*(ddp_worker.batch(step, rank) for rank in (0, 1)))
        loss = torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys))
        opt.zero_grad()
        torch.autograd.backward(loss)
        opt.step()
    expected = [p.detach().flatten() for p in model.parameters()]
    for rank, r in reports.items():
        assert r["device"] == f"sim:{rank}" and r["param_devices"] == [f"sim:{rank}"]
        assert r["backend"] == "simgloo" and r["default_backend_for_sim"] == "simgloo"
        for got, want in zip(r["params"], expected):
            assert torch.allclose(torch.tensor(got), want, atol=1e-6), rank
        assert r["memory_own_device"] > 0 and r["memory_other_device"] == 0
        assert r["all_reduce"] == [3.0] * 3 and r["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0]
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]] and r["broadcast"] == [10.0, 10.0]
        assert r["reduce_scatter_tensor"] == [[0.0, 2.0], [4.0, 6.0]][rank] and r["results_on"] == [f"sim:{rank}"]
        assert r["recv"] == [[0.0, 0.0], [5.0, 5.0]][rank]
        assert r["object_device"] == "sim:0" and r["object_values"] == [0.0, 1.0, 2.0]  # the sender's tag (FACTS 30)
        assert r["remapped_device"] == f"sim:{rank}"
    assert reports[0]["params"] == reports[1]["params"]  # bitwise: DDP kept the replicas identical
    assert reports[1]["memory_other_device_after_object"] > 0  # rank 1's copy of the object sits on sim:0
    assert reports[0]["memory_other_device_after_object"] == 0


BOOT_FIRST = """
import time, torch
from tests.accelerator import engine_has_threads
from tests.accelerator.worker_boot import boot
start = time.monotonic()
device = boot()
seconds = time.monotonic() - start
x = torch.ones(2, device=device, requires_grad=True)
torch.autograd.backward((x * 3).sum())
print(device, x.grad.device, torch.accelerator.device_count(), engine_has_threads(), seconds)
"""

BACKWARD_FIRST = """
import torch
from tests.accelerator import enabled, engine_has_threads
torch.autograd.backward((torch.ones(2, requires_grad=True) * 3).sum())  # autograd starts with no sim device
with enabled(2):
    x = torch.ones(2, device="sim:1", requires_grad=True)
    torch.autograd.backward((x * 3).sum())
    print(x.grad.device, x.grad.cpu().tolist(), engine_has_threads())
"""


def test_fresh_processes_boot_without_building(sim_worker_env: dict[str, str]) -> None:
    env = {**os.environ, **sim_worker_env, "LOCAL_RANK": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        for code in (BOOT_FIRST, BACKWARD_FIRST)
    ]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    device, grad_device, count, threads, seconds = outs[0][0].split()
    assert device == grad_device == "sim:1" and count == "2" and threads == "True"
    assert float(seconds) < 2.0  # loaded, not compiled: no build of it takes under 2 s
    # autograd started before the library loaded: enabled() runs backward on the calling thread instead
    assert outs[1][0].split() == ["sim:1", "[3.0,", "3.0]", "False"]
