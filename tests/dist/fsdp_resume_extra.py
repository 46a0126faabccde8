"""More sources into FSDP2 models, for tests/dist/fsdp_resume_workers.py's launches (no launch of their own):
``CheckpointManager.resume(init_from=...)`` of a weights-only file and of a DDP file, a ``.safetensors`` file, HF
Trainer and Accelerate folders (written the cheap way: ``safetensors.torch.save_file`` of the full state dict, the
optimizer's ``state_dict()`` as the libraries save it), EMA models, and ``load_checkpoint`` of a sharded folder."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import dist_resume as dr
from dist_resume._core.shards import is_dtensor
from dist_resume.errors import DistResumeError
from tests.dist.fsdp_save_workers import _full
from tests.dist.fsdp_workers import Net, _differ
from tests.helpers import local_shard

Make = Callable[[int], tuple[nn.Module, torch.optim.Optimizer, Any]]


def _expected(raw: dict[str, Any], optimizer: bool) -> dict[str, torch.Tensor]:
    """A single-GPU file's model (and optimizer state, integer ids mapped to Net's parameter names) flattened like
    :func:`_full`."""
    flat = dict(raw["model"])
    if optimizer:
        names = [n for n, _ in Net().named_parameters()]
        for i, state in raw["optimizer"]["state"].items():
            flat.update({f"{names[i]}/{k}": v for k, v in state.items()})
    return flat


def _restored(model: nn.Module, opt: torch.optim.Optimizer, expected: dict[str, torch.Tensor]) -> list[str]:
    """The entries of ``expected`` the FSDP2 model's full state (collective) differs in, on rank 0; [] elsewhere."""
    full = _full(model, opt)
    if dist.get_rank() != 0:
        return []
    return _differ({k: full[k] for k in expected if k in full}, expected) + sorted(expected.keys() - full.keys())


def _write_foreign(root: Path, raw: dict[str, Any]) -> None:
    """Rank 0: the single-GPU state as a weights-only file, a .safetensors file, HF Trainer and Accelerate folders."""
    model = {k: v.contiguous() for k, v in raw["model"].items()}
    torch.save(model, root / "weights.pt")
    save_file(model, str(root / "weights.safetensors"))
    hf = root / "hf" / "checkpoint-3"
    hf.mkdir(parents=True)
    save_file(model, str(hf / "model.safetensors"))
    torch.save(raw["optimizer"], hf / "optimizer.pt")
    torch.save(raw["scheduler"], hf / "scheduler.pt")
    (hf / "trainer_state.json").write_text(json.dumps({"global_step": 3, "epoch": 1.0}))
    acc = root / "accelerate"
    acc.mkdir()
    save_file(model, str(acc / "model.safetensors"))
    torch.save(raw["optimizer"], acc / "optimizer.bin")


def more_sources(rank: int, root: Path, make: Make) -> dict[str, Any]:
    """At 2 ranks, after fsdp_resume_workers._two wrote single.pt, ddp2.pt and run2/."""
    raw = torch.load(root / "single.pt", weights_only=True)
    if rank == 0:
        _write_foreign(root, raw)
    dist.barrier()
    report: dict[str, Any] = {}
    weights, everything = _expected(raw, optimizer=False), _expected(raw, optimizer=True)
    # the usual fine-tune start: a new manager folder, init_from a weights-only file: only the model, bit for bit
    model, opt, sched = make(9)
    res = dr.CheckpointManager(root / "finetune", model=model, optimizer=opt, scheduler=sched).resume(
        init_from=root / "weights.pt"
    )
    assert res is not None, "init_from restored nothing"
    report["init_weights"] = (res.step, res.restored, _restored(model, opt, weights))
    model, opt, sched = make(9)  # init_from a DDP file with optimizer state: model and optimizer, bit for bit
    res = dr.CheckpointManager(root / "finetune_ddp", model=model, optimizer=opt).resume(init_from=root / "ddp2.pt")
    assert res is not None, "init_from restored nothing"
    ddp_raw = torch.load(root / "ddp2.pt", weights_only=True)
    names = [n for g in ddp_raw["optimizer"]["param_groups"] for n in g["param_names"]]
    ddp_flat = dict(ddp_raw["model"])
    for i, state in ddp_raw["optimizer"]["state"].items():
        ddp_flat.update({f"{names[i]}/{k}": v for k, v in state.items()})
    report["init_ddp"] = (res.step, res.restored, _restored(model, opt, ddp_flat))
    # a .safetensors file, an HF Trainer checkpoint-N/ and an Accelerate folder
    for name, path, expected, parts in (
        ("safetensors", root / "weights.safetensors", weights, {}),
        ("hf", root / "hf" / "checkpoint-3", everything, {"optimizer", "scheduler"}),
        ("accelerate", root / "accelerate", everything, {"optimizer"}),
        ("hf_broadcast", root / "hf" / "checkpoint-3", everything, {"optimizer", "scheduler", "broadcast"}),
    ):
        model, opt, sched = make(9)
        res = dr.resume(
            path,
            model=model,
            optimizer=opt if "optimizer" in parts else None,
            scheduler=sched if "scheduler" in parts else None,
            options=dr.ResumeOptions(rng=False, broadcast_from_rank0="broadcast" in parts),
        )
        report[name] = (res.layout.value, res.restored, _restored(model, opt, expected))
    report.update(_ema(rank, root, make))
    if rank == 0:  # load_checkpoint of a sharded folder: local (rank 0 alone), the full state on the CPU
        loaded = dr.load_checkpoint(root / "run2" / "ckpt_00000003.dcp")
        at_save = torch.load(root / "references.pt", weights_only=True)["at_save"]
        model_keys = {k: v for k, v in at_save.items() if "/" not in k}
        Net().load_state_dict(loaded["model"])  # full tensors: a plain model takes them
        named = "param_names" in loaded["optimizer"]["param_groups"][0]
        report["load_checkpoint"] = (sorted(loaded), _differ(dict(loaded["model"]), model_keys), named)
    return report


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state as this rank holds it: its shards of DTensors, plain tensors whole."""
    return {k: local_shard(v) if is_dtensor(v) else v for k, v in module.state_dict().items()}


def _sharded_ema(model: nn.Module, seed: int) -> AveragedModel:
    """What docs/fsdp2.md recommends: an AveragedModel of a plain copy, its module sharded like the model."""
    torch.manual_seed(seed)
    ema = AveragedModel(Net(), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    fully_shard(ema.module, mesh=next(iter(model.parameters())).device_mesh)  # type: ignore[attr-defined]
    return ema


def _ema(rank: int, root: Path, make: Make) -> dict[str, Any]:
    """EMA next to an FSDP2 model: an AveragedModel of a plain copy whose module is sharded like the model (it
    updates shard by shard), and one left whole on every rank; a sharded EMA next to a plain model is refused."""
    report: dict[str, Any] = {}
    model, opt, sched = make(0)
    torch.manual_seed(21)
    plain_ema = AveragedModel(Net())
    plain_ema.n_averaged += 4
    sharded_ema = _sharded_ema(model, 22)
    for step in range(2):
        x = torch.randn(8, 5, generator=torch.Generator().manual_seed(step)).chunk(dist.get_world_size())[rank]
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        sharded_ema.update_parameters(model)  # DTensor into DTensor, each rank its shards
    for ema, name in ((plain_ema, "ema_plain"), (sharded_ema, "ema_sharded")):
        folder = dr.save_checkpoint(root / f"{name}.dcp", model=model, optimizer=opt, ema=ema, step=1)
        full = dr.save_checkpoint(root / f"{name}.pt", model=model, optimizer=opt, ema=ema, step=1, full_state=True)
        for how, path in (("folder", folder), ("full", full)):
            fresh, fresh_opt, _ = make(5)
            if ema is plain_ema:
                torch.manual_seed(23)
                into = AveragedModel(Net())
            else:
                into = _sharded_ema(fresh, 23)
            res = dr.resume(path, model=fresh, optimizer=fresh_opt, ema=into)
            report[f"{name}_{how}"] = (res.restored, _differ(_own(into), _own(ema)))
    report["ema_sharded_n_averaged"] = int(sharded_ema.n_averaged)
    try:
        dr.resume(root / "ema_sharded.pt", model=Net(), ema=sharded_ema)
        report["ema_sharded_plain_model"] = None
    except DistResumeError as err:
        report["ema_sharded_plain_model"] = (type(err).__name__, str(err))
    return report


def more_sources_other(root: Path, make: Make) -> dict[str, Any]:
    """At 4 ranks (2x2 HSDP) and 1: init_from the weights-only file, the HF folder, bit for bit."""
    raw = torch.load(root / "single.pt", weights_only=True)
    report: dict[str, Any] = {}
    model, opt, sched = make(9)
    res = dr.CheckpointManager(root / f"finetune{dist.get_world_size()}", model=model, optimizer=opt).resume(
        init_from=root / "weights.pt"
    )
    assert res is not None, "init_from restored nothing"
    report["init_weights"] = (res.step, res.restored, _restored(model, opt, _expected(raw, optimizer=False)))
    model, opt, sched = make(9)
    res = dr.resume(root / "hf" / "checkpoint-3", model=model, optimizer=opt, scheduler=sched)
    report["hf"] = (res.layout.value, res.restored, _restored(model, opt, _expected(raw, optimizer=True)))
    return report


def apply_faults(root: Path, make: Make) -> dict[str, Any]:
    """A fault at each small step of an FSDP2 apply (scheduler, RNG) and inside the fill (the optimizer's load):
    ``{target: (error class, part, shards unchanged, scheduler unchanged, RNG unchanged)}``. Local (1-rank launch)."""
    from tests.dist.fsdp_workers import _locals

    out: dict[str, Any] = {}
    for target in ("scheduler", "rng", "fill"):
        model, opt, sched = make(11)
        before, sched_before, rng_before = _locals(model, opt), dict(sched.state_dict()), torch.get_rng_state()

        def boom(*_: Any, _target: str = target, **__: Any) -> None:
            raise RuntimeError(f"injected into the {_target}")

        cls = type(sched)
        real_load = cls.load_state_dict
        if target == "scheduler":  # the live scheduler's load fails, not the copy validation loads into

            def load_live(self: Any, state: Any, _live: Any = sched, _real: Any = real_load) -> None:
                if self is _live:
                    raise RuntimeError("injected into the scheduler")
                _real(self, state)

            cls.load_state_dict = load_live  # type: ignore[method-assign]  # the fault is the point
        elif target == "fill":
            opt.load_state_dict = boom  # type: ignore[method-assign]  # the fault is the point
        real_set = torch.set_rng_state

        def set_once(state: torch.Tensor, _calls: list[int] = [], _real: Any = real_set) -> None:  # noqa: B006
            _calls.append(1)  # the restore fails; putting the stream back works
            if len(_calls) == 1:
                raise RuntimeError("injected into the rng")
            _real(state)

        if target == "rng":
            torch.set_rng_state = set_once  # type: ignore[assignment]  # the fault is the point
        try:
            dr.resume(root / "full2.pt", model=model, optimizer=opt, scheduler=sched)
            err: Any = None
        except Exception as caught:
            err = caught
        finally:
            torch.set_rng_state = real_set
            cls.load_state_dict = real_load  # type: ignore[method-assign]
        out[target] = (
            type(err).__name__,
            getattr(err, "part", None),
            _differ(_locals(model, opt), before) == [],
            sched.state_dict() == sched_before,
            torch.equal(torch.get_rng_state(), rng_before),
        )
    return out
