"""DDP with each rank on its own accelerator device, under the real torchrun: one node of 2 ranks, two nodes of 2.

One body for the test accelerator (``sim`` devices, the simgloo backend) and CUDA (nccl; the multi-GPU job): the
``accelerator`` fixture chooses the device type, ``init_distributed()`` in the worker the backend. A launch costs
10-25 s here, so each runs several scenarios (tests/dist/accelerator_worker.py) and this side checks their reports:
a single-process checkpoint (tagged ``<type>:0`` or ``cuda:3``) -> DDP with and without ``broadcast_from_rank0``,
DDP -> single process, an elastic restart after a SIGKILL that ends bitwise equal to an uninterrupted run, and on
every rank its own device, never another's.
Timeouts nest: the worker's process group (60 s) < the launch (240 s) < pytest (300 s).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from tests import accelerator as sim
from tests.dist import accelerator_worker
from tests.dist import ddp_workers as W
from tests.dist.harness import run_torchrun, run_two_nodes
from tests.helpers import save_with_device_tag
from tests.models import assert_same

pytestmark = pytest.mark.dist

WORKER = str(Path(accelerator_worker.__file__))
BACKENDS = {"sim": "simgloo", "cuda": "nccl"}  # what init_distributed() picks for the device type
LAUNCH_TIMEOUT = 240.0
SCENARIOS = "single_to_ddp,single_to_ddp_broadcast,ddp_save"  # accelerator_worker's, in both launches


def _worker_env(accelerator: sim.Accel) -> dict[str, str]:
    return sim.worker_env(accelerator.count) if accelerator.type == "sim" else {}


def _single_checkpoint(accelerator: sim.Accel, folder: Path) -> dict[str, torch.Tensor]:
    """``folder/single.pt``: three steps of one process on device 0 (its tensors tagged ``<type>:0``), and the same
    state tagged ``cuda:3`` (``single_cuda3.pt``: from a GPU that no rank here has)."""
    model, opt, sched = W.make(seed=0)
    accelerator.move(model, 0)  # the optimizer keeps the live Parameters
    W.train(model, opt, sched, steps=3, seed=7, device=accelerator.device(0))
    path = dr.save_checkpoint(folder / "single.pt", model=model, optimizer=opt, scheduler=sched, step=3, epoch=1)
    save_with_device_tag(torch.load(path, map_location="cpu", weights_only=True), folder / "single_cuda3.pt")
    return W.flat_state(model, opt)


def _reports(proc: Any, folder: Path, attempt: int, world: int) -> dict[int, dict[str, Any]]:
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    reports = {rank: folder / f"attempt{attempt}_rank{rank}.json" for rank in range(world)}
    missing = [str(p) for p in reports.values() if not p.is_file()]
    assert not missing, f"no report {missing}\n{proc.stderr[-6000:]}"
    return {rank: json.loads(path.read_text()) for rank, path in reports.items()}


def _state(folder: Path, scenario: str, attempt: int, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(folder / f"{scenario}_attempt{attempt}_rank{rank}.pt", weights_only=True)


def _check_placement(accelerator: sim.Accel, r: dict[str, Any], local_rank: int) -> None:
    own = f"{accelerator.type}:{local_rank}"
    assert r["local_rank"] == local_rank and r["device"] == r["current_device"] == own
    assert r["backend"] == BACKENDS[accelerator.type]


def _check_single_to_ddp(r: dict[str, Any], folder: Path, rank: int, expected: dict[str, torch.Tensor]) -> None:
    """A single-process checkpoint resumed into DDP: exact state, each rank's own device, nothing elsewhere."""
    for scenario in ("single_to_ddp", "single_to_ddp_broadcast"):
        found = r[scenario]
        assert found["step"] == 3 and found["restored"][:3] == ["model", "optimizer", "scheduler"], scenario
        assert found["devices"] == {"model": [r["device"]], "optimizer": [r["device"]], "step": ["cpu"]}, scenario
        assert found["peak_on_other_devices"] == 0, (scenario, rank)  # a broadcast device tensor would sit on :0
        assert_same(_state(folder, scenario, 0, rank), expected)
        assert found["lr"] == pytest.approx(1e-2 * 0.5) and found["same_on_every_rank"], scenario
    assert r["single_to_ddp"]["loaded_devices"] == {"single.pt": [r["device"]], "single_cuda3.pt": [r["device"]]}


def _check_single_and_ddp(
    accelerator: sim.Accel, reports: dict[int, dict[str, Any]], folder: Path, expected: dict[str, torch.Tensor]
) -> None:
    """Every rank of the first attempt on its own device (devices 0, 1 of its node), single -> DDP and DDP -> single."""
    for rank, r in reports.items():
        assert r["node_rank"] == rank // 2 and r["world_size"] == len(reports)  # two ranks per node, node-major
        _check_placement(accelerator, r, rank % 2)  # global ranks 2 and 3 take devices 0 and 1 of their node
        _check_single_to_ddp(r, folder, rank, expected)
        assert r["ddp_save"]["exists"] and r["ddp_save"]["peak_on_other_devices"] == 0
    _check_ddp_to_single(accelerator, folder, _state(folder, "ddp_save", 0, 0))


def _check_ddp_to_single(accelerator: sim.Accel, folder: Path, writer: dict[str, torch.Tensor]) -> None:
    """The DDP run's checkpoint (written by rank 0, tagged ``<type>:0``) resumed by one process on device 1."""
    assert not any(k.startswith("module.") for k in torch.load(folder / "ddp.pt", weights_only=True)["model"])
    model, opt, sched = W.make(seed=123)
    accelerator.move(model, 1)
    result = dr.resume(folder / "ddp.pt", model=model, optimizer=opt, scheduler=sched)
    assert (result.step, result.epoch) == (3, 0)
    dr.check_devices(model, opt)
    assert {t.device for t in model.state_dict().values()} == {accelerator.device(1)}
    assert_same(W.flat_state(model, opt), writer)


@pytest.mark.e2e
@sim.on_accelerators(2)
@pytest.mark.timeout(300)
def test_two_ranks_single_and_ddp_both_ways_and_an_elastic_restart_ends_bitwise_equal(
    accelerator: sim.Accel, tmp_path: Path
) -> None:
    expected = _single_checkpoint(accelerator, tmp_path)
    args = [WORKER, str(tmp_path), accelerator.type, f"{SCENARIOS},elastic"]
    proc = run_torchrun(
        args,
        nproc=2,
        cwd=tmp_path,
        env=_worker_env(accelerator),
        timeout=LAUNCH_TIMEOUT,
        extra_torchrun_args=["--max-restarts=1"],
    )
    first, second = _reports(proc, tmp_path, 0, 2), _reports(proc, tmp_path, 1, 2)
    _check_single_and_ddp(accelerator, first, tmp_path, expected)

    # the elastic run: rank 1 SIGKILLed itself after step 4 of 6; torchrun restarted the group, which resumed the
    # checkpoint of step 3 (model, optimizer, sampler position, every rank's RNG streams) and finished
    assert first[1]["killed_after"] == accelerator_worker.KILL_AT and "exitcode: -9" in proc.stdout + proc.stderr
    for rank, r in second.items():
        _check_placement(accelerator, r, rank)
        found = r["elastic"]
        assert found["step"] == accelerator_worker.SAVE_AT and found["restored"][-2:] == ["sampler", "rng"]
        assert found["devices"] == {"model": [r["device"]], "optimizer": [r["device"]], "step": ["cpu"]}
        assert found["peak_on_other_devices"] == 0
        assert found["losses"] == first[rank]["uninterrupted_losses"][accelerator_worker.SAVE_AT :], rank
        assert_same(_state(tmp_path, "resumed", 1, rank), _state(tmp_path, "uninterrupted", 0, rank))


@pytest.mark.slow
@sim.on_accelerators(2)
@pytest.mark.timeout(300)
def test_two_nodes_of_two_ranks_place_by_local_rank_single_and_ddp_both_ways(
    accelerator: sim.Accel, tmp_path: Path
) -> None:
    node_env: tuple[dict[str, str], ...] = ({}, {})  # every sim process has its own two devices
    if accelerator.type == "cuda":  # one machine as two nodes: each agent gets two GPUs of its own
        accelerator.need(4)
        node_env = ({"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"})
    expected = _single_checkpoint(accelerator, tmp_path)
    args = [WORKER, str(tmp_path), accelerator.type, SCENARIOS]
    nodes = run_two_nodes(
        args, nproc_per_node=2, cwd=tmp_path, env=_worker_env(accelerator), node_env=node_env, timeout=LAUNCH_TIMEOUT
    )
    for node in nodes:
        assert node.returncode == 0, f"exit {node.returncode}\n{node.stdout[-4000:]}\n{node.stderr[-6000:]}"
    reports = _reports(nodes[0], tmp_path, 0, 4)
    _check_single_and_ddp(accelerator, reports, tmp_path, expected)
