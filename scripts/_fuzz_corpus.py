"""The fuzz corpus: files this toolkit writes and the foreign layouts resume reads, and the live objects a resume
case restores into. The mutations of its files are ``_fuzz_mutate``'s."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """The model every corpus file holds (and every resume case restores into)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)


ADAMW_ITEMS = ("lightning", "hf")  # saved from AdamW built from named_parameters() (param_names); the rest from SGD


def trained(
    seed: int = 0, steps: int = 1, optimizer: str = "sgd"
) -> tuple[Net, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler]:
    """The objects the corpus is saved from (``seed`` 0, one step), or, with another seed and more steps, live
    objects whose every state differs from the corpus's: a resume that raises must leave them as they were, and
    only a difference from the file shows whether it did. ``optimizer``: ``"sgd"`` (momentum) or ``"adamw"``."""
    torch.manual_seed(seed)
    model = Net()
    opt: torch.optim.Optimizer
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    for _ in range(steps):
        opt.zero_grad()
        model.fc2(model.fc1(torch.ones(3, 8))).sum().backward()
        opt.step()
        sched.step()
    if seed:
        scaler.scale(torch.ones(()))  # the scale is created lazily; update(new_scale) then changes it
        scaler.update(2.0**10 + seed)
    return model, opt, sched, scaler


def averaged(model: nn.Module, updates: int = 1) -> torch.optim.swa_utils.AveragedModel:
    """An EMA of ``model`` (torch's AveragedModel) after ``updates`` updates: what ``ema=`` saves and restores."""
    ema = torch.optim.swa_utils.AveragedModel(model)
    for _ in range(updates):
        ema.update_parameters(model)
    return ema


def build_corpus(folder: Path) -> dict[str, Path]:
    """Write the seed files; return name -> path (a folder for ``manager`` and the foreign folders)."""
    import dist_resume as dr

    folder.mkdir(parents=True, exist_ok=True)
    model, opt, sched, scaler = trained()
    sd, osd = model.state_dict(), opt.state_dict()
    out: dict[str, Path] = {}
    out["own"] = Path(
        dr.save_checkpoint(
            folder / "own.pt",
            model=model,
            optimizer=opt,
            scheduler=sched,
            scaler=scaler,
            ema=averaged(model),
            step=7,
            epoch=1,
            rng=True,
        )
    )
    adamw, adamw_sched = trained(optimizer="adamw")[1:3]
    aosd, asched = adamw.state_dict(), adamw_sched.state_dict()
    lightning = {  # the keys a Lightning Trainer writes (a LightningModule whose layers are fc1 and fc2)
        "epoch": 1,
        "global_step": 3,
        "pytorch-lightning_version": "2.4.0",
        "state_dict": sd,
        "loops": {"fit_loop": {"state_dict": {}, "epoch_progress": {"current": {"completed": 1}}}},
        "callbacks": {},
        "optimizer_states": [aosd],
        "lr_schedulers": [asched],
        "hparams_name": "kwargs",
        "hyper_parameters": {"lr": 0.1},
    }
    for name, obj, suffix in (
        ("bare", sd, ".pt"),
        ("model_optimizer", {"model": sd, "optimizer": osd, "epoch": 1}, ".pt"),
        ("state_dict", {"state_dict": sd}, ".pt"),
        ("model_state_dict", {"model_state_dict": sd, "optimizer_state_dict": osd, "epoch": 1}, ".pt"),
        ("lightning", lightning, ".ckpt"),
        ("snapshot", {"MODEL_STATE": sd, "EPOCHS_RUN": 3}, ".pt"),  # the PyTorch DDP tutorial's snapshot
        # a hand-written script's names, one level down, with a loss history beside them: detection by content
        (
            "free_named",
            {
                "state": {"net": sd, "opt": osd, "sched": sched.state_dict()},
                "it": 3,
                "history": [[0.5, 0.4], {"lr": [0.1]}],
            },
            ".pt",
        ),
    ):
        torch.save(obj, folder / f"{name}{suffix}")
        out[name] = folder / f"{name}{suffix}"
    out["safetensors"] = _safetensors(folder / "bare.pt", folder / "model.safetensors")
    out["hf"] = _hf_trainer(folder / "checkpoint-3", sd, aosd, asched)
    out["hf_sharded"] = _hf_sharded(folder / "sharded" / "checkpoint-3", sd)
    out["accelerate"] = _accelerate(folder / "accelerate", sd, osd, sched.state_dict())
    out["dcp"] = _dcp(folder / "dcp", sd, osd)
    out["sharded_run"] = _sharded_run(folder / "sharded_run", model, opt, sched, scaler)
    manager = folder / "manager"
    if manager.exists():
        shutil.rmtree(manager)
    with dr.CheckpointManager(manager, keep_last=2) as mgr:
        for step in (1, 2):
            mgr.save(step, model=model, optimizer=opt, scheduler=sched, scaler=scaler, ema=averaged(model, step))
    out["manager"] = manager
    return out


def _safetensors(src: Path, dst: Path) -> Path:
    """A ``.safetensors`` file written by dist_resume's own writer (the safetensors package is not needed)."""
    import dist_resume as dr

    dr.tools.convert_checkpoint(src, dst, format="safetensors", force=True)
    return dst


def _fresh(folder: Path) -> Path:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    return folder


def _trainer_state(folder: Path) -> None:
    state = {"global_step": 3, "epoch": 1.0, "max_steps": 10, "log_history": [{"loss": 0.5, "step": 3}]}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def _hf_trainer(folder: Path, sd: dict[str, Any], osd: dict[str, Any], ssd: dict[str, Any]) -> Path:
    """The files of an HF Trainer ``checkpoint-N/``, written here: running the real transformers Trainer
    would take seconds per corpus build and pull a large dependency into the fuzz run."""
    _fresh(folder)
    torch.save(sd, folder / "weights.pt")
    _safetensors(folder / "weights.pt", folder / "model.safetensors")
    (folder / "weights.pt").unlink()
    torch.save(osd, folder / "optimizer.pt")
    torch.save(ssd, folder / "scheduler.pt")
    _trainer_state(folder)
    return folder


def _hf_sharded(folder: Path, sd: dict[str, Any]) -> Path:
    """An HF Trainer checkpoint whose weights are two safetensors shards and their index."""
    _fresh(folder)
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[:2], "model-00002-of-00002.safetensors": keys[2:]}
    weight_map: dict[str, str] = {}
    for shard, names in shards.items():
        torch.save({k: sd[k] for k in names}, folder / "part.pt")
        _safetensors(folder / "part.pt", folder / shard)
        weight_map.update(dict.fromkeys(names, shard))
    (folder / "part.pt").unlink()
    total = sum(t.numel() * t.element_size() for t in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _trainer_state(folder)
    return folder


def _accelerate(folder: Path, sd: dict[str, Any], osd: dict[str, Any], ssd: dict[str, Any]) -> Path:
    """The files of an Accelerate ``save_state`` folder (one model, one optimizer, one scheduler)."""
    _fresh(folder)
    torch.save(sd, folder / "weights.pt")
    _safetensors(folder / "weights.pt", folder / "model.safetensors")
    (folder / "weights.pt").unlink()
    torch.save(osd, folder / "optimizer.bin")
    torch.save(ssd, folder / "scheduler.bin")
    return folder


def _dcp(folder: Path, sd: dict[str, Any], osd: dict[str, Any]) -> Path:
    """A torch.distributed.checkpoint folder of ``{"model", "optim"}``, saved without a process group."""
    import torch.distributed.checkpoint as dcp

    _fresh(folder)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": sd, "optim": osd}, checkpoint_id=str(folder), no_dist=True)
    return folder


def _sharded_run(folder: Path, model: Net, opt: Any, sched: Any, scaler: Any) -> Path:
    """A run folder of two sharded checkpoints (``ckpt_1.dcp/``, ``ckpt_2.dcp/``: what an FSDP2 model saves),
    written by ``convert_checkpoint(format="sharded")`` in one process: DCP files, train_state.pt, manifest.json."""
    import dist_resume as dr

    _fresh(folder)
    for step in (1, 2):
        objects = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "ema": averaged(model, step)}
        one = dr.save_checkpoint(folder / f"step{step}.pt", **objects, step=step, epoch=0, rng=True)
        dr.tools.convert_checkpoint(one, folder / f"ckpt_{step}.dcp", format="sharded")
        one.unlink()
    return folder


RESTORES = {
    "own": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "manager": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "sharded_run": ("model", "optimizer", "scheduler", "scaler", "ema"),
    "model_optimizer": ("model", "optimizer"),
    "model_state_dict": ("model", "optimizer"),
    "bare": ("model",),
    "state_dict": ("model",),
    "lightning": ("model", "optimizer", "scheduler"),
    "snapshot": ("model",),
    "free_named": ("model", "optimizer", "scheduler"),
    "safetensors": ("model",),
    "hf": ("model", "optimizer", "scheduler"),
    "hf_sharded": ("model",),
    "accelerate": ("model", "optimizer", "scheduler"),
    "dcp": ("model", "optimizer"),
}
"""What resume is given for each corpus item: what the unmutated item holds (so it succeeds)."""


def newest_file(folder: Path) -> Path:
    """The file a folder case mutates: its newest checkpoint."""
    return sorted(p for p in folder.iterdir() if p.name.startswith("ckpt_"))[-1]


def members(folder: Path) -> list[str]:
    """The files of a folder corpus item a case may mutate or delete, relative to it (a manager folder: its newest
    checkpoint; a run of sharded checkpoints: every file of the newest ``ckpt_<step>.dcp/``)."""
    if any(p.name.startswith("ckpt_") for p in folder.iterdir()):
        newest = newest_file(folder)
        if newest.is_dir():
            return sorted(f"{newest.name}/{p.name}" for p in newest.iterdir())
        return [newest.name]
    return sorted(p.name for p in folder.iterdir() if p.is_file())
