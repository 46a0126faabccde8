"""Per-rank bodies for tests/dist/test_fsdp.py: FSDP2 (fully_shard on a CPU mesh, gloo) against DSD, bit for bit."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # the oracle, private to torch

from dist_resume._dist.shard_comm import gather_full, scatter_full_into
from dist_resume._format import stream_write
from dist_resume._save.full_state import save_full_state
from dist_resume._state.adapt import adapt_state_dict
from dist_resume._state.optim.prepare import prepare_optimizer_state
from dist_resume._state.optim.sharded import load_full_optimizer_state, sharded_optimizer_state
from dist_resume._state.sharded import (
    check_optimizer_follows,
    is_sharded,
    load_full_model_state,
    model_destinations,
    sharded_parameters,
)
from dist_resume.errors import CheckpointWriteError, OptimizerStateMismatchError
from tests.helpers import local_shard
from tests.models import compile_module

FULL = StateDictOptions(full_state_dict=True)
FULL_CPU = StateDictOptions(full_state_dict=True, cpu_offload=True)


class Net(nn.Module):
    """Uneven shards everywhere: 3 and 7 rows over 2 or 4 ranks, and a 1-row weight that leaves ranks empty."""

    scale: torch.Tensor  # a registered buffer (nn.Module types attribute access as Tensor | Module)

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(3, 7)
        self.c = nn.Linear(7, 1)
        self.register_buffer("scale", torch.arange(1.0, 4.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)) * self.scale)))


def _mesh(world_size: int) -> Any:
    if world_size == 4:
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # HSDP
    return init_device_mesh("cpu", (world_size,))


def _sharded(mesh: Any, seed: int, per_layer: bool = True) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    if per_layer:
        for layer in (model.a, model.b, model.c):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 5, generator=g)).square().mean().backward()
        opt.step()


def _failed_saves(rank: int, folder: Path, state: dict[str, Any]) -> list[str]:
    """Saves that fail on rank 0 (no such folder; the disk full in the middle of the data): every rank raises
    rank 0's error, none is left blocked in a send, no temporary file stays, and the group still works."""
    errors = []
    real = stream_write.write_all  # type: ignore[attr-defined]  # the name stream_write imported (patched there)
    calls = 0

    def full_disk(fd: int, data: Any, offset: int) -> None:
        nonlocal calls
        calls += 1
        if calls > 6:  # tensor data only: the seventh piece, three tensors into the file
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, data, offset)

    for target, patch in ((folder / "missing" / "x.pt", False), (folder / "x.pt", True)):
        stream_write.write_all = full_disk if patch and rank == 0 else real  # type: ignore[attr-defined]  # as above
        try:
            save_full_state(target, state, bucket_bytes=16)
        except CheckpointWriteError as err:
            errors.append(str(err))
        finally:
            stream_write.write_all = real  # type: ignore[attr-defined]  # as above
    dist.barrier()
    leftovers = sorted(p.name for p in folder.iterdir() if p.name.startswith(".x.pt"))
    return [*errors, f"leftovers {leftovers}"]


def _locals(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shards of every parameter and state tensor, as plain tensors."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = local_shard(p).detach().clone()
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}/{key}"] = (value.to_local() if isinstance(value, DTensor) else value).detach().clone()
    for name, b in model.named_buffers():
        out[name] = b.clone()
    return out


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys {sorted(a.keys() ^ b.keys())}"]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def _by_name(osd: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """A plain Optimizer.state_dict() keyed by parameter name, the form DSD takes (FACTS 33)."""
    groups = [{**g, "params": [names[i] for i in g["params"]]} for g in osd["param_groups"]]
    for g in groups:
        g.pop("param_names", None)
    return {"state": {names[i]: dict(s) for i, s in osd["state"].items()}, "param_groups": groups}


def meta_stand_ins(obj: Any) -> Any:
    """``obj`` with every tensor a meta tensor of its shape and dtype: what a rank that reads no file holds."""
    if isinstance(obj, torch.Tensor):
        return torch.empty_like(obj, device="meta")
    if isinstance(obj, dict):
        return {k: meta_stand_ins(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [meta_stand_ins(v) for v in obj]
    return obj


def against_dsd(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Full CPU checkpoint -> FSDP2 three ways (every rank copies its boxes, rank 0 scatters, DSD), then gathers."""
    mesh = _mesh(world_size)
    ckpt, out_file = Path(folder) / "plain.pt", Path(folder) / "full.pt"
    if rank == 0:  # the single-GPU run that saved the checkpoint
        torch.manual_seed(0)
        plain = Net()
        plain_opt = torch.optim.AdamW(plain.named_parameters(), lr=0.05, weight_decay=0.1)
        _train(plain, plain_opt, steps=1, seed=1)
        torch.save({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()}, ckpt)
    dist.barrier()
    saved = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)
    names = [n for n, _ in Net().named_parameters()]
    report: dict[str, Any] = {}

    # the description of every parameter is DTensor's own
    ours, our_opt = _sharded(mesh, seed=10)  # no optimizer state yet: it is built from the file
    report["is_sharded"] = is_sharded(ours) and is_sharded(compile_module(ours)) and not is_sharded(Net())
    specs = sharded_parameters(compile_module(ours))  # canonical names through torch.compile
    report["spec_names"] = list(specs)
    spec_mismatch = []
    for n, p in ours.named_parameters():
        assert isinstance(p, DTensor), f"{n}: not a DTensor"  # torch types a sharded module's parameters as Parameter
        box = tuple(map(tuple, compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)))
        if (specs[n].local_shape, specs[n].offset) != box or tuple(p.to_local().shape) != specs[n].local_shape:
            spec_mismatch.append(n)
    report["spec_mismatch"] = spec_mismatch
    report["placements"] = str(specs["a.weight"].placements)

    # (1) every rank copies its boxes out of its own mapping of the file; a fresh optimizer gets its state built
    load_full_model_state(ours, saved["model"])
    load_full_optimizer_state(our_opt, prepare_optimizer_state(saved["optimizer"], our_opt, ours))
    # (2) DSD, every rank given the full state (names, not ids: FACTS 33)
    theirs, their_opt = _sharded(mesh, seed=20)
    set_model_state_dict(theirs, dict(saved["model"]), options=FULL)  # a copy: DSD puts DTensors in the dict
    set_optimizer_state_dict(theirs, their_opt, _by_name(saved["optimizer"], names), options=FULL)
    # (3) rank 0 sends each rank its boxes; the others pass meta stand-ins; existing state is filled in place
    scattered, scat_opt = _sharded(mesh, seed=30, per_layer=False)
    _train(scattered, scat_opt, steps=1, seed=99)  # state exists: it is written in place
    before = {id(v) for s in scat_opt.state.values() for v in s.values()}
    source = saved if rank == 0 else meta_stand_ins(saved)
    pairs = [(full, dst) for _, full, dst in model_destinations(scattered, source["model"])]
    opt_sd, opt_pairs = sharded_optimizer_state(
        scat_opt, prepare_optimizer_state(source["optimizer"], scat_opt, scattered)
    )
    scatter_full_into(pairs + opt_pairs)
    scat_opt.load_state_dict(opt_sd)
    report["state_kept_in_place"] = {id(v) for s in scat_opt.state.values() for v in s.values()} == before

    # (4) a compiled, root-only wrapped model: its keys carry _orig_mod., re-keyed as resume re-keys them
    inner, inner_opt = _sharded(mesh, seed=40, per_layer=False)
    compiled = compile_module(inner)
    load_full_model_state(compiled, adapt_state_dict(saved["model"], compiled))

    mine = _locals(ours, our_opt)
    report["compiled_vs_dsd"] = _differ(
        _locals(inner, inner_opt), _locals(theirs, torch.optim.SGD(theirs.parameters()))
    )
    report["loaded_vs_dsd"] = _differ(mine, _locals(theirs, their_opt))
    report["scattered_vs_dsd"] = _differ(_locals(scattered, scat_opt), _locals(theirs, their_opt))
    report["checked"] = len(mine)

    # both continue bit for bit
    for model, opt in ((ours, our_opt), (theirs, their_opt), (scattered, scat_opt)):
        _train(model, opt, steps=2, seed=5 + rank)
    report["trained_vs_dsd"] = _differ(_locals(ours, our_opt), _locals(theirs, their_opt))
    report["scattered_trained_vs_dsd"] = _differ(_locals(scattered, scat_opt), _locals(theirs, their_opt))

    # gathers: ours to rank 0 against DSD's full state dicts
    # full_state_dict: plain tensors only; the optimizer's "state" is keyed by name (DSD types both loosely)
    full_model = cast(dict[str, torch.Tensor], get_model_state_dict(theirs, options=FULL_CPU))
    full_optim = cast(dict[str, Any], get_optimizer_state_dict(theirs, their_opt, options=FULL_CPU))
    gathered = {n: gather_full(t, bucket_bytes=16) for n, t in [*ours.named_parameters(), *ours.named_buffers()]}
    for n, p in ours.named_parameters():
        for key, value in our_opt.state[p].items():
            gathered[f"{n}/{key}"] = gather_full(value, bucket_bytes=1 << 20)
    # the streaming writer: one ordinary file, gathered in 16-byte parts
    save_full_state(out_file, {"model": ours.state_dict(), "optimizer": our_opt.state_dict()}, bucket_bytes=16)
    report["failed_saves"] = _failed_saves(
        rank, Path(folder), {"model": ours.state_dict(), "optimizer": our_opt.state_dict()}
    )
    try:
        check_optimizer_follows(ours, torch.optim.SGD(Net().parameters(), lr=0.1))  # built before fully_shard
    except OptimizerStateMismatchError as err:
        report["stale_optimizer"] = str(err)
    check_optimizer_follows(ours, our_opt)
    if rank == 0:
        expected = {**full_model, **{f"{n}/{k}": v for n, s in full_optim["state"].items() for k, v in s.items()}}
        got = {k: v for k, v in gathered.items() if v is not None}
        report["gathered_vs_dsd"] = _differ({k: got[k] for k in expected if k in got}, expected)
        report["gathered"] = len(got)
        written = torch.load(out_file, weights_only=True)
        plain = Net()
        plain.load_state_dict(written["model"])  # strict: loads into a plain model like any checkpoint
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.05, weight_decay=0.1)
        plain_opt.load_state_dict(written["optimizer"])
        as_named = {**written["model"]}
        for i, s in written["optimizer"]["state"].items():
            as_named.update({f"{names[i]}/{k}": v for k, v in s.items()})
        report["written_vs_dsd"] = _differ({k: as_named[k] for k in expected}, expected)
        report["written_keys"] = sorted(written)
    else:
        report["gathered"] = sum(v is not None for v in gathered.values())
    return report
