"""Checkpoints written by the real libraries' own save code, generated once per session.

Each fixture skips (``pytest.importorskip``) when its library is not installed: install the test
extra ``dist-resume[interop]`` in the same pip command as torch. The torchvision-references and timm
style file is *reproduced* (their save calls, copied), not produced by torchvision or timm, which
must not be installed next to CPU torch.
"""

from __future__ import annotations

import argparse
import copy
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn


@dataclass
class Saved:
    """Where a library saved, and what it saved (CPU copies taken right after the save)."""

    path: Path
    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None = None
    scheduler: dict[str, Any] | None = None
    step: int | None = None
    epoch: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _snapshot(obj: Any) -> Any:
    return copy.deepcopy(obj)


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """transformers ``Trainer`` with a tiny random ``BertConfig``: ``checkpoint-2/`` after 2 steps."""
    pytest.importorskip("transformers", reason="needs transformers (pip install dist-resume[interop])")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    out = tmp_path_factory.mktemp("hf")
    config = BertConfig(
        vocab_size=32,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
        num_labels=2,  # type: ignore[call-arg]  # a PreTrainedConfig keyword; BertConfig's typed signature omits it
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    data = [{"input_ids": torch.randint(0, 32, (6,)), "labels": torch.tensor(i % 2)} for i in range(8)]
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=2,
        save_steps=2,
        save_strategy="steps",
        per_device_train_batch_size=4,
        weight_decay=0.1,
        report_to=[],
        use_cpu=True,
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data)  # type: ignore[arg-type]
    trainer.train()
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None  # train() made them
    return Saved(
        out / "checkpoint-2",
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        _snapshot(trainer.optimizer.state_dict()),
        _snapshot(trainer.lr_scheduler.state_dict()),
        step=2,
        epoch=1,
        extra={"hf_model": model},
    )


@pytest.fixture(scope="session")
def hf_sharded(hf_checkpoint: Saved, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same weights through ``save_pretrained(max_shard_size=...)``: shards + ``model.safetensors.index.json``."""
    out = tmp_path_factory.mktemp("hf_sharded")
    hf_checkpoint.extra["hf_model"].save_pretrained(out, max_shard_size="2KB")
    return out


@pytest.fixture(scope="session")
def accelerate_state(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """``Accelerator.save_state`` with two models and two optimizers (``model_1.safetensors``, ``optimizer_1.bin``)."""
    pytest.importorskip("accelerate", reason="needs accelerate (pip install dist-resume[interop])")
    from accelerate import Accelerator

    out = tmp_path_factory.mktemp("accelerate") / "state"
    accelerator = Accelerator(cpu=True)
    model, second = _tiny(), nn.Linear(3, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    second_opt = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    model, optimizer, scheduler, second, second_opt = accelerator.prepare(
        model, optimizer, scheduler, second, second_opt
    )
    for _ in range(2):
        loss = model(torch.randn(5, 4)).square().sum() + second(torch.randn(2, 3)).sum()
        accelerator.backward(loss)
        optimizer.step()
        second_opt.step()
        scheduler.step()
        optimizer.zero_grad()
        second_opt.zero_grad()
    accelerator.save_state(str(out))
    return Saved(
        out,
        {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()},
        _snapshot(optimizer.state_dict()),
        _snapshot(scheduler.state_dict()),
    )


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(path))


@pytest.fixture(scope="session")
def dcp_plain(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """``dcp.save({"model": sd, "optim": optim.state_dict()})`` in one process (int ids, stored as digit strings)."""
    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    out = tmp_path_factory.mktemp("dcp") / "plain"
    _dcp_save({"model": model.state_dict(), "optim": optimizer.state_dict()}, out)
    return Saved(out, _snapshot(model.state_dict()), _snapshot(optimizer.state_dict()))


@pytest.fixture(scope="session")
def dcp_dsd(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """``dcp.save`` of DSD's ``get_state_dict(model, optim)``: optimizer state keyed by FQN."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _tiny()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    out = tmp_path_factory.mktemp("dcp") / "dsd"
    _dcp_save({"model": model_sd, "optim": optim_sd}, out)
    return Saved(out, _snapshot(model.state_dict()), _snapshot(optimizer.state_dict()))


@pytest.fixture(scope="session")
def lightning_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """Lightning ``Trainer`` + ``ModelCheckpoint`` after 2 steps; the module keeps the net as ``self.model``."""
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install dist-resume[interop])")
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = _tiny()

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.model(batch[0]).square().sum()  # type: ignore[no-any-return]

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    out = tmp_path_factory.mktemp("lightning")
    module = Tiny()
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=out, filename="last", save_top_k=1)
    trainer = pl.Trainer(
        max_steps=2,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[checkpoint],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return Saved(
        out / "last.ckpt",
        _snapshot(module.model.state_dict()),
        _snapshot(trainer.optimizers[0].state_dict()),
        _snapshot(trainer.lr_scheduler_configs[0].scheduler.state_dict()),
        step=2,
    )


@pytest.fixture(scope="session")
def torchvision_timm_file(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """REPRODUCED, not produced by torchvision or timm: their scripts' save calls, copied.

    torchvision references/classification/train.py saves ``{"model", "optimizer", "lr_scheduler",
    "epoch", "args": argparse.Namespace, "model_ema": AveragedModel.state_dict()}``; timm's
    CheckpointSaver adds ``state_dict_ema`` and keeps decay / no-decay optimizer groups.
    """
    from torch.optim.swa_utils import AveragedModel

    model = _tiny()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)
    ema = AveragedModel(model)
    _train(model, optimizer)
    scheduler.step()
    ema.update_parameters(model)
    args = argparse.Namespace(model="tiny", lr=0.5, epochs=3)
    checkpoint = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "epoch": 1,
        "args": args,
        "model_ema": ema.state_dict(),  # torchvision references
        "state_dict_ema": ema.module.state_dict(),  # timm
    }
    out = tmp_path_factory.mktemp("tv_timm") / "checkpoint.pth"
    torch.save(checkpoint, out)
    return Saved(
        out,
        _snapshot(model.state_dict()),
        _snapshot(optimizer.state_dict()),
        _snapshot(scheduler.state_dict()),
        epoch=1,
        extra={"ema": _snapshot(ema.state_dict()), "args": args},
    )
