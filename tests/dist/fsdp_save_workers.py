"""Per-rank body for tests/dist/test_fsdp_save.py: saves from FSDP2 (fully_shard on a CPU mesh, gloo), many checks per
launch. Every check compares bit for bit: with the model's own shards (``dcp.load`` into a fresh FSDP2 model through
DSD's state dicts), or with DSD's full state dict (``full_state_dict=True``)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

import dist_resume as dr
from dist_resume._foreign.dcp_metadata import read_dcp_metadata
from dist_resume._save import sharded as sharded_save
from dist_resume.cli import main as cli_main
from dist_resume.errors import CheckpointWriteError, UsageError
from tests.dist.fsdp_workers import Net, _differ, _locals, _mesh, _sharded, _train
from tests.helpers import local_shard
from tests.models import compile_module

FULL_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """DSD's full state (collective), flattened to ``{name or name/state key: tensor}``; ``{}`` off rank 0. Copies:
    DSD hands out the live tensor where one is whole already (``step``), which training then changes."""
    # full_state_dict: plain tensors only; the optimizer's "state" is keyed by name (DSD types both loosely)
    model_sd = cast(dict[str, torch.Tensor], get_model_state_dict(model, options=FULL_CPU))
    optim_sd = cast(dict[str, Any], get_optimizer_state_dict(model, opt, options=FULL_CPU))
    flat = dict(model_sd)
    for name, state in optim_sd.get("state", {}).items():
        flat.update({f"{name}/{k}": v for k, v in state.items()})
    return {k: v.clone() for k, v in flat.items()}


def _from_file(obj: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A dist_resume file's model and optimizer state flattened like :func:`_full` (optimizer by param_names)."""
    flat = dict(obj["model"])
    names = [n for g in obj["optimizer"]["param_groups"] for n in g["param_names"]]
    for i, state in obj["optimizer"]["state"].items():
        flat.update({f"{names[i]}/{k}": v for k, v in state.items()})
    return flat


def _dcp_loaded(mesh: Any, path: Path, per_layer: bool = True) -> tuple[Net, torch.optim.Optimizer]:
    """A fresh FSDP2 model and optimizer that ``dcp.load`` filled from ``path`` through DSD's sharded state dicts."""
    model, opt = _sharded(mesh, seed=77, per_layer=per_layer)
    state: dict[str, Any] = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optimizer"])
    return model, opt


def _cli(*argv: str | Path) -> tuple[int, str, str]:
    """``dist-resume`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


def _plain(step: int = 0) -> tuple[Net, torch.optim.Optimizer, Any]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    return model, opt, torch.optim.lr_scheduler.StepLR(opt, 1)


def _failure(rank: int, world_size: int, mgr: dr.CheckpointManager, where: str) -> dict[str, Any]:
    """``mgr.save(200)`` with one failure injected: in DCP's write on the last rank, reading back its files on the
    last rank, or the commit on rank 0. Every rank's error class and message, and what the folder holds after."""
    last = world_size - 1
    patches = {
        "dcp_write": (FileSystemWriter, "write_data", last, OSError(errno.ENOSPC, "No space left on device")),
        "read_back": (sharded_save, "file_entry", last, OSError(errno.EIO, "Input/output error")),
        "commit": (sharded_save, "commit_folder", 0, OSError(errno.EACCES, "Permission denied")),
    }
    owner, name, victim, exc = patches[where]
    real = getattr(owner, name)

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise exc

    if rank == victim:
        setattr(owner, name, broken)
    outcome: dict[str, Any]
    try:
        mgr.save(200)
        outcome = {"error": None}
    except CheckpointWriteError as err:
        outcome = {"error": type(err).__name__, "message": str(err), "rank": err.rank}
    finally:
        setattr(owner, name, real)
    dist.barrier()
    outcome["entries"] = sorted(os.listdir(mgr.folder))
    outcome["latest"] = None
    if rank == 0:
        latest = mgr.latest()
        assert latest is not None, "no checkpoint left after the failed save"
        outcome["latest"] = latest.name
    return outcome


def sharded_saves(rank: int, world_size: int, folder: str, earlier: str | None) -> dict[str, Any]:
    mesh = _mesh(world_size)
    root = Path(folder) / f"ws{world_size}"
    if rank == 0:
        root.mkdir()
    dist.barrier()
    report: dict[str, Any] = {}

    # 1) the manager's default save of an FSDP2 model: a sharded checkpoint folder
    model, opt = _sharded(mesh, seed=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    _train(model, opt, steps=2, seed=1)
    sched.step()
    sampler = dr.ResumableDistributedSampler(64, shuffle=True, seed=3)
    it = iter(sampler)
    for _ in range(5):
        next(it)
    mgr = dr.CheckpointManager(root / "run", model=model, optimizer=opt, scheduler=sched, sampler=sampler, keep_last=2)
    torch.manual_seed(1000 + rank)  # every rank's own RNG stream
    rng_before = torch.get_rng_state()
    first = Path(mgr.save(100))
    kept = Path(dr.save_checkpoint(root / "kept.dcp", model=model, optimizer=opt, step=100))  # outside the manager
    saved_locals = _locals(model, opt)
    saved_full = _full(model, opt)
    report["first"] = first.name
    if rank == 0:
        manifest = json.loads((first / "manifest.json").read_text())
        report["files"] = sorted(os.listdir(first))
        report["manifest"] = {k: manifest[k] for k in ("format", "step", "world_size", "mesh_shape", "writers")}
        report["manifest_files"] = sorted(f["name"] for f in manifest["files"])
        latest = mgr.latest()
        assert latest is not None, "no checkpoint after mgr.save(100)"
        report["latest"] = latest.name
        info = dr.tools.inspect_checkpoint(first)
        report["info"] = (info.step, info.layout, info.size == sum(f["size"] for f in manifest["files"]))
        keys = list(read_dcp_metadata(first).state_dict_metadata)
        report["dcp_keys_canonical"] = all("_orig_mod" not in k and ".module." not in k for k in keys)
        report["optimizer_by_name"] = any(k == "optimizer.state.a.weight.exp_avg" for k in keys)
        train_state = torch.load(first / "train_state.pt", weights_only=True)
        report["train_state_keys"] = sorted(train_state)
        report["sampler"] = train_state["sampler"]["consumed"]
        report["scheduler"] = train_state["scheduler"] == sched.state_dict()
        report["rng_ranks"] = len(train_state["rng"])
        report["rng0_is_rank0s"] = torch.equal(train_state["rng"][0]["torch"], rng_before)
        report["cli_inspect"] = _cli("inspect", "--json", first)  # the CLI on the folder every rank wrote
        report["cli_list"] = _cli("list", "--verify", "--json", root / "run")
        report["cli_verify"] = _cli("verify", first, first)
    rng_saved: list[bool | None] = [None] * world_size
    dist.all_gather_object(rng_saved, torch.equal(torch.get_rng_state(), rng_before))  # saving draws nothing
    report["rng_untouched"] = all(rng_saved)
    if rank == 0:
        torch.save(saved_full, root / "reference.pt")  # what another world size must load

    # 2) dcp.load reads it back bit for bit into a fresh FSDP2 model (per layer, and root-only wrapped)
    report["dcp_load"] = _differ(_locals(*_dcp_loaded(mesh, first)), saved_locals)
    report["dcp_load_root_only"] = _differ(_locals(*_dcp_loaded(mesh, first, per_layer=False)), saved_locals)
    report["kept"] = _differ(_locals(*_dcp_loaded(mesh, kept)), saved_locals)

    # 3) FSDP2 -> plain: every rank resumes the manager folder (its newest is the folder) into a plain model
    plain, plain_opt, plain_sched = _plain()
    res = dr.resume(root / "run", model=plain, optimizer=plain_opt, scheduler=plain_sched)
    report["plain_resume"] = (res.path.name, res.step, res.layout.value)
    if rank == 0:
        report["plain_vs_dsd"] = _differ(
            _from_file({"model": plain.state_dict(), "optimizer": _named(plain_opt)}), saved_full
        )

    try:  # a sharded checkpoint is a folder: a file name is refused on every rank, before anything is written
        dr.save_checkpoint(root / "x.pt", model=model)
        report["file_name"] = ""
    except UsageError as err:
        report["file_name"] = str(err)

    # 4) full_state=True: one ordinary file gathered on rank 0, the payload a DDP save writes
    full = dr.save_checkpoint(root / "full.pt", model=model, optimizer=opt, scheduler=sched, step=100, full_state=True)
    mgr_full = dr.CheckpointManager(root / "runfull", model=model, optimizer=opt, full_state=True)
    report["full_manager"] = mgr_full.save(100).name
    mgr_full.close()
    if rank == 0:
        written = torch.load(full, weights_only=True)
        report["full_keys"] = sorted(written)
        report["full_vs_dsd"] = _differ(_from_file(written), saved_full)
        report["full_rng_ranks"] = len(written["rng"])
    plain2, plain2_opt, _ = _plain()
    dr.resume(full, model=plain2, optimizer=plain2_opt)  # every rank reads the one file into a plain model
    if rank == 0:
        report["full_resumed_vs_dsd"] = _differ(
            _from_file({"model": plain2.state_dict(), "optimizer": _named(plain2_opt)}), saved_full
        )

    # 5) convert: the folder to one file and back to a folder (one writer, full tensors), which loads into FSDP2
    if rank == 0:
        conv = dr.tools.convert_checkpoint(first, root / "conv.pt").dst
        report["conv_vs_dsd"] = _differ(_from_file(torch.load(conv, weights_only=True)), saved_full)
        back = dr.tools.convert_checkpoint(conv, root / "back.dcp", format="sharded").dst
        again = dr.tools.convert_checkpoint(back, root / "again.pt").dst
        report["round_trip"] = _differ(_from_file(torch.load(again, weights_only=True)), saved_full)
    dist.barrier()
    report["back_into_fsdp"] = _differ(_locals(*_dcp_loaded(mesh, root / "back.dcp")), saved_locals)
    if earlier is not None:  # the folder the 2-rank run saved, into this run's shards (DCP reshards on load)
        loaded = _full(*_dcp_loaded(mesh, Path(earlier)))
        if rank == 0:
            report["earlier_vs_its_dsd"] = _differ(loaded, torch.load(Path(earlier).parent / "reference.pt"))

    # 6) a failure on one rank before the rename: every rank raises the same error, nothing counts, nothing stays
    report["failures"] = {
        where: _failure(rank, world_size, mgr, where) for where in ("dcp_write", "read_back", "commit")
    }

    # 7) save_async: every rank writes in a thread from a copy; training goes on meanwhile
    before = _locals(model, opt)
    handle = mgr.save_async(200)
    with torch.no_grad():  # at once, while the thread plans: the save must hold the values it was called with
        for p in model.parameters():
            local_shard(p).add_(1.0)
    report["async"] = handle.wait().name
    _train(model, opt, steps=1, seed=9)
    report["async_vs_before"] = _differ(_locals(*_dcp_loaded(mesh, root / "run" / "ckpt_00000200.dcp")), before)

    # 8) leftovers, rotation (a folder deleted whole), damage skipped with its reason, every rank on one choice
    if rank == 0:
        (root / "run" / ".ckpt_00000250.dcp.0123456789abcdef.tmp").mkdir()
    dist.barrier()
    mgr.save(300)
    report["after_rotation"] = sorted(os.listdir(root / "run")) if rank == 0 else None
    if rank == 0:
        with open(root / "run" / "ckpt_00000300.dcp" / f"__{world_size - 1}_0.distcp", "r+b") as f:
            f.seek(40)
            byte = f.read(1)
            f.seek(40)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    if rank == 0:  # the CLI names the damaged shard
        report["cli_damaged"] = (
            _cli("verify", root / "run" / "ckpt_00000300.dcp", first),
            _cli("list", "--verify", "--json", root / "run"),
        )
    chosen = dr.resume(root / "run", model=_plain()[0])
    report["damaged_skipped"] = chosen.path.name
    mgr.close()

    # 9) torch.compile of a root-only wrapped model: canonical keys; it loads into a per-layer wrapped one
    inner, inner_opt = _sharded(mesh, seed=40, per_layer=False)
    _train(inner, inner_opt, steps=1, seed=2)
    compiled_dest = Path(
        dr.save_checkpoint(root / "compiled.dcp", model=compile_module(inner), optimizer=inner_opt, step=1)
    )
    report["compiled"] = _differ(_locals(*_dcp_loaded(mesh, compiled_dest)), _locals(inner, inner_opt))
    if rank == 0:
        keys = list(read_dcp_metadata(compiled_dest).state_dict_metadata)
        report["compiled_keys_canonical"] = all("_orig_mod" not in k for k in keys)

    # 10) at 4 ranks: a 1-D mesh of 4 saves, the 2x2 HSDP model loads it (4-way shards into 2-way), and back
    if world_size == 4:
        flat_mesh = init_device_mesh("cpu", (4,))
        flat, flat_opt = _sharded(flat_mesh, seed=50)
        _train(flat, flat_opt, steps=1, seed=4)
        flat_full = _full(flat, flat_opt)
        path = Path(dr.save_checkpoint(root / "flat.dcp", model=flat, optimizer=flat_opt, step=1))
        into_hsdp, into_flat = _full(*_dcp_loaded(mesh, path)), _full(*_dcp_loaded(flat_mesh, kept))  # collectives
        report["flat_into_hsdp"] = _differ(into_hsdp, flat_full) if rank == 0 else []
        report["hsdp_into_flat"] = _differ(into_flat, saved_full) if rank == 0 else []

    return report


def _named(opt: torch.optim.Optimizer) -> dict[str, Any]:
    """A plain Net's optimizer state with param_names, for :func:`_from_file`."""
    sd = opt.state_dict()
    names = [n for n, _ in Net().named_parameters()]
    groups = [{**g, "param_names": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": sd["state"], "param_groups": groups}
