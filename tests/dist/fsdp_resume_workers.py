"""Per-rank body for tests/dist/test_fsdp_resume.py: ``resume`` and ``CheckpointManager.resume`` into FSDP2 models
(fully_shard on a CPU mesh, gloo), every direction, compared bit for bit (same world size) or within a stated fp32
tolerance (another world size) with the run that was not interrupted.

Every run trains on the same global batch of 8 rows per step, split evenly over the ranks, so that the mean of the
ranks' gradients is the global batch's at any world size. Three launches share one folder: 2 ranks (writes the
checkpoints and the references), then 4 ranks (2x2 HSDP), then 1 rank.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from dist_resume._foreign.dcp_metadata import read_dcp_metadata
from dist_resume._format.manifest import file_crc32
from dist_resume.errors import DistResumeError
from tests.dist.fsdp_resume_extra import apply_faults, more_sources, more_sources_other
from tests.dist.fsdp_save_workers import _full
from tests.dist.fsdp_workers import Net, _differ, _locals, _mesh
from tests.models import compile_module

STEPS, STOP = 3, 6  # interrupted after STEPS, continued to STOP


def _mesh_of(world_size: int) -> Any:
    return init_device_mesh("cpu", (1,)) if world_size == 1 else _mesh(world_size)


def _fsdp(mesh: Any, seed: int, per_layer: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = Net()
    if per_layer:
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, *_opt(model)


def _opt(model: nn.Module, named: bool = False) -> tuple[torch.optim.Optimizer, Any]:
    params = model.named_parameters() if named else model.parameters()
    opt = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _ddp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = DDP(Net())
    return model, *_opt(model)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, sched: Any, start: int, stop: int, alone: bool = False
) -> None:
    """Steps ``start`` to ``stop``, this rank's share of each global batch (all of it when ``alone``)."""
    rank, world_size = (0, 1) if alone else (dist.get_rank(), dist.get_world_size())
    for step in range(start, stop):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(100 + step)).chunk(world_size)[rank]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sched.step()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _diff_on_rank0(model: nn.Module, opt: torch.optim.Optimizer, reference: dict[str, torch.Tensor]) -> float:
    """The largest difference from ``reference`` of the full state (collective), on rank 0; 0 elsewhere."""
    full = _full(model, opt)
    return _max_diff(full, reference) if dist.get_rank() == 0 else 0.0


def _resumed(path: Path, model: nn.Module, opt: Any, sched: Any, **options: Any) -> tuple[Any, ...]:
    res = dr.resume(path, model=model, optimizer=opt, scheduler=sched, options=dr.ResumeOptions(**options))
    return res.step, res.restored, res.applied.get("optimizer")


def _refusal(fn: Any, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``fn()`` must raise a dist_resume error and leave ``model`` and ``opt`` as they were."""
    before = _locals(model, opt)
    try:
        fn()
        out: dict[str, Any] = {"error": None}
    except DistResumeError as err:
        out = {"error": type(err).__name__, "message": str(err), "rank": err.rank}
    except Exception as err:  # a raw torch error: the defect this test exists for
        out = {"error": f"raw {type(err).__name__}", "message": str(err)[:300], "rank": None}
    out["unchanged"] = _differ(_locals(model, opt), before)
    return out


def _two(rank: int, root: Path, mesh: Any) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # the uninterrupted FSDP2 run, and the same run saved at STEPS by the manager (a sharded folder)
    ref, ref_opt, ref_sched = _fsdp(mesh, seed=0)
    _train(ref, ref_opt, ref_sched, 0, STOP)
    reference = _full(ref, ref_opt)
    saved, saved_opt, saved_sched = _fsdp(mesh, seed=0)
    _train(saved, saved_opt, saved_sched, 0, STEPS)
    mgr = dr.CheckpointManager(root / "run2", model=saved, optimizer=saved_opt, scheduler=saved_sched)
    mgr.save(STEPS)
    mgr.close()
    dr.save_checkpoint(
        root / "full2.pt", model=saved, optimizer=saved_opt, scheduler=saved_sched, step=STEPS, full_state=True
    )
    at_save = _locals(saved, saved_opt)
    at_save_full = _full(saved, saved_opt)
    # torch's own DCP folder of DSD's sharded state dicts (optimizer keyed by name), as an FSDP2 user writes it
    dcp.save(
        {"model": get_model_state_dict(saved), "optim": get_optimizer_state_dict(saved, saved_opt)},
        checkpoint_id=root / "dcp2",
    )

    # FSDP2@2 -> FSDP2@2: the folder (dcp.load into the shards), its full_state file, broadcast from rank 0
    for name, path, options in (
        ("fsdp_folder", root / "run2", {}),
        ("fsdp_full_file", root / "full2.pt", {}),
        ("fsdp_broadcast", root / "run2", {"broadcast_from_rank0": True}),
    ):
        model, opt, sched = _fsdp(mesh, seed=9)
        report[f"{name}_result"] = _resumed(path, model, opt, sched, **options)
        report[f"{name}_at_save"] = _differ(_locals(model, opt), at_save)
        _train(model, opt, sched, STEPS, STOP)
        report[name] = _differ(_full(model, opt), reference)
    model, opt, sched = _fsdp(mesh, seed=9, per_layer=False)
    report["dcp_result"] = dr.resume(root / "dcp2", model=model, optimizer=opt).restored
    report["dcp_at_save"] = _differ(_full(model, opt), at_save_full)
    # CheckpointManager.resume, into a model wrapped at the root only
    model, opt, sched = _fsdp(mesh, seed=9, per_layer=False)
    result = dr.CheckpointManager(root / "run2", model=model, optimizer=opt, scheduler=sched).resume()
    assert result is not None, "CheckpointManager.resume found no checkpoint in run2"
    report["manager_result"] = result.step
    _train(model, opt, sched, STEPS, STOP)
    report["manager_root_only"] = _diff_on_rank0(model, opt, reference)
    # FSDP2@2 -> DDP@2
    model, opt, sched = _ddp(seed=9)
    report["to_ddp_result"] = _resumed(root / "run2", model, opt, sched)
    _train(model, opt, sched, STEPS, STOP)
    report["to_ddp"] = _differ(_full(model, opt), reference)
    # torch.compile of a root-only wrapped model: _orig_mod. keys adapted
    inner, opt, sched = _fsdp(mesh, seed=9, per_layer=False)
    report["compiled_result"] = _resumed(root / "run2", compile_module(inner), opt, sched)
    report["compiled"] = _differ(_locals(inner, opt), at_save)

    # DDP@2 -> FSDP2@2 continues as DDP itself does; by every rank's mapping of the file, and from rank 0
    ddp, ddp_opt, ddp_sched = _ddp(seed=0)
    _train(ddp, ddp_opt, ddp_sched, 0, STEPS)
    dr.save_checkpoint(root / "ddp2.pt", model=ddp, optimizer=ddp_opt, scheduler=ddp_sched, step=STEPS)
    _train(ddp, ddp_opt, ddp_sched, STEPS, STOP)
    ddp_reference = _full(ddp, ddp_opt)
    for name, options in (("from_ddp", {}), ("from_ddp_broadcast", {"broadcast_from_rank0": True})):
        model, opt, sched = _fsdp(mesh, seed=9)
        report[f"{name}_result"] = _resumed(root / "ddp2.pt", model, opt, sched, **options)
        _train(model, opt, sched, STEPS, STOP)
        report[name] = _differ(_full(model, opt), ddp_reference)
    report["ddp_vs_fsdp"] = _differ(ddp_reference, reference)

    # a single-GPU file written by hand, optimizer state keyed by integer ids (no param_names): world size 1 -> 2
    at_single: dict[str, torch.Tensor] = {}
    single_reference: dict[str, torch.Tensor] = {}
    if rank == 0:
        torch.manual_seed(0)
        single = Net()
        single_opt, single_sched = _opt(single)
        _train(single, single_opt, single_sched, 0, STEPS, alone=True)
        raw = {
            "model": single.state_dict(),
            "optimizer": single_opt.state_dict(),
            "scheduler": single_sched.state_dict(),
            "step": STEPS,
        }
        torch.save(raw, root / "single.pt")
        wrong_shape = {**raw, "model": {**raw["model"], "b.weight": torch.zeros(7, 4)}}  # one tensor of the wrong shape
        torch.save(wrong_shape, root / "bad.pt")
        at_single = _full(single, single_opt)
        _train(single, single_opt, single_sched, STEPS, STOP, alone=True)
        single_reference = _full(single, single_opt)
    dist.barrier()
    model, opt, sched = _fsdp(mesh, seed=9)
    report["single_result"] = _resumed(root / "single.pt", model, opt, sched, rng=False)
    got = _full(model, opt)
    report["single_at_save"] = _differ(got, at_single) if rank == 0 else []
    report["single_step"] = float(got["a.weight/step"]) if rank == 0 else STEPS
    _train(model, opt, sched, STEPS, STOP)
    report["single_continued"] = _diff_on_rank0(model, opt, single_reference)
    model, opt, sched = _fsdp(mesh, seed=9)  # DSD's trap exactly: integer ids with broadcast_from_rank0 (FACTS 33)
    report["single_broadcast_result"] = _resumed(
        root / "single.pt", model, opt, sched, rng=False, broadcast_from_rank0=True
    )
    got = _full(model, opt)
    report["single_broadcast_at_save"] = _differ(got, at_single) if rank == 0 else []

    # refusals: same typed error on every rank, nothing changed anywhere
    model, opt, sched = _fsdp(mesh, seed=5)
    _train(model, opt, sched, 0, 1)
    bad = root / ("bad.pt" if rank == 1 else "single.pt")  # only rank 1 would fail
    report["bad_everywhere"] = _refusal(lambda: _resumed(root / "bad.pt", model, opt, sched, rng=False), model, opt)
    report["bad_on_rank1"] = _refusal(lambda: _resumed(bad, model, opt, sched, rng=False), model, opt)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    report["wrong_optimizer"] = _refusal(lambda: dr.resume(root / "run2", model=model, optimizer=sgd), model, opt)
    report["missing_on_rank1"] = _refusal(
        lambda: _resumed(root / ("nothing.pt" if rank == 1 else "single.pt"), model, opt, sched, rng=False), model, opt
    )
    # a damaged shard: found by verify=True before anything changes, else while the shards fill (every rank raises)
    if rank == 0:
        shutil.copytree(root / "run2" / f"ckpt_{STEPS:08d}.dcp", root / "damaged.dcp")
        with open(root / "damaged.dcp" / "__1_0.distcp", "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    report["damaged_verified"] = _refusal(
        lambda: _resumed(root / "damaged.dcp", model, opt, sched, verify=True), model, opt
    )
    report["damaged"] = _refusal(lambda: _resumed(root / "damaged.dcp", model, opt, sched), model, opt)
    if rank == 0:  # now a tensor's chunk (b.weight's, in rank 1's file): its header is read with the CRC-32s
        shutil.rmtree(root / "damaged.dcp")
        shutil.copytree(root / "run2" / f"ckpt_{STEPS:08d}.dcp", root / "damaged.dcp")
        storage = read_dcp_metadata(root / "damaged.dcp").storage_data
        (info,) = [v for k, v in storage.items() if k.fqn == "model.b.weight" and v.relative_path == "__1_0.distcp"]
        with open(root / "damaged.dcp" / "__1_0.distcp", "r+b") as f:
            f.seek(info.offset)  # its local zip header
            f.write(b"\xff\xff")
        manifest = json.loads((root / "damaged.dcp" / "manifest.json").read_text())  # its CRC-32 made to match:
        for entry in manifest["files"]:  # what the ranks check before the fill passes, the fill finds it
            if entry["name"] == "__1_0.distcp":
                entry["crc32"] = f"{file_crc32(root / 'damaged.dcp' / '__1_0.distcp'):08x}"
        (root / "damaged.dcp" / "manifest.json").write_text(json.dumps(manifest))
    dist.barrier()
    report["damaged_header"] = _refusal(lambda: _resumed(root / "damaged.dcp", model, opt, sched), model, opt)
    try:  # the check of the entries' headers patched out: found only while the shards fill
        with mock.patch("dist_resume._format.sharded_files.entries_problem", lambda *_: None):
            _resumed(root / "damaged.dcp", model, opt, sched)
        report["damaged_chunk"] = None
    except DistResumeError as err:
        report["damaged_chunk"] = (type(err).__name__, str(err))
    if rank == 0:
        refs = {"reference": reference, "ddp_reference": ddp_reference, "at_save": at_save_full}
        torch.save(refs, root / "references.pt")
    dist.barrier()
    report.update(more_sources(rank, root, lambda seed: _fsdp(mesh, seed)))
    return report


def _other(rank: int, world_size: int, root: Path, mesh: Any) -> dict[str, Any]:
    """Checkpoints written at 2 ranks resumed at ``world_size`` (4: 2x2 HSDP; 1), continued, against the 2-rank
    references; at 4 ranks the manager's folder is also written again, for the 1-rank run."""
    refs = torch.load(root / "references.pt", weights_only=True)
    report: dict[str, Any] = {}
    for name, path, reference, options in (
        ("folder", root / "run2", refs["reference"], {}),
        ("folder_broadcast", root / "run2", refs["reference"], {"broadcast_from_rank0": True}),
        ("full_file", root / "full2.pt", refs["reference"], {}),
        ("ddp_file", root / "ddp2.pt", refs["ddp_reference"], {}),
    ):
        model, opt, sched = _fsdp(mesh, seed=9)
        report[f"{name}_result"] = _resumed(path, model, opt, sched, **options)
        _train(model, opt, sched, STEPS, STOP)
        report[name] = _diff_on_rank0(model, opt, reference)
    model, opt, sched = _fsdp(mesh, seed=9)  # torch's DCP folder written at 2 ranks: restored exactly
    report["dcp_result"] = dr.resume(root / "dcp2", model=model, optimizer=opt).restored
    full = _full(model, opt)  # collective
    report["dcp_at_save"] = _differ(full, refs["at_save"]) if rank == 0 else []
    model, opt, sched = _fsdp(mesh, seed=9, per_layer=False)
    mgr = dr.CheckpointManager(root / "run2", model=model, optimizer=opt, scheduler=sched)
    result = mgr.resume()
    assert result is not None, "CheckpointManager.resume found no checkpoint in run2"
    report["manager_result"] = result.step
    if world_size == 4:  # the 2-rank folder saved again from 4 ranks, for the 1-rank run
        mgr4 = dr.CheckpointManager(root / "run4", model=model, optimizer=opt, scheduler=sched)
        mgr4.save(STEPS)
        mgr4.close()
    _train(model, opt, sched, STEPS, STOP)
    report["manager"] = _diff_on_rank0(model, opt, refs["reference"])
    if world_size == 1:
        model, opt, sched = _fsdp(mesh, seed=9)
        report["from_four_result"] = _resumed(root / "run4", model, opt, sched)
        _train(model, opt, sched, STEPS, STOP)
        report["from_four"] = _max_diff(_full(model, opt), refs["reference"])
        # full_state=True on a 1-rank mesh: the DTensors' local values are whole (once failed with 'Bad address')
        full1 = dr.save_checkpoint(root / "full1.pt", model=model, optimizer=opt, full_state=True)
        written = torch.load(full1, weights_only=True)
        report["full_at_one"] = _differ(
            dict(written["model"]), {k: v for k, v in _full(model, opt).items() if "/" not in k}
        )
        report["apply_faults"] = apply_faults(root, lambda seed: _fsdp(mesh, seed))
    model, opt, sched = _fsdp(mesh, seed=5)
    _train(model, opt, sched, 0, 1)
    bad = root / ("bad.pt" if rank == world_size - 1 else "single.pt")  # only the last rank would fail
    report["bad_on_last"] = _refusal(lambda: _resumed(bad, model, opt, sched, rng=False), model, opt)
    report.update(more_sources_other(root, lambda seed: _fsdp(mesh, seed)))
    return report


def fsdp_resumes(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    root = Path(folder)
    mesh = _mesh_of(world_size)
    return _two(rank, root, mesh) if world_size == 2 else _other(rank, world_size, root, mesh)
