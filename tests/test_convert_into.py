"""``dist-resume convert FILE --into FOLDER``: another run's checkpoint as a CheckpointManager folder's checkpoint of
its step, so that ``CheckpointManager(FOLDER).resume()`` continues that run there."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume import tools
from dist_resume.errors import UsageError
from tests.models import compile_module

Run = Callable[..., tuple[int, str, str]]


class TinyGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(8, 4)
        self.ln = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln(self.wte(idx)))


def nanogpt_optimizer(model: nn.Module) -> torch.optim.AdamW:
    """nanoGPT's configure_optimizers: decay for 2-D parameters, none for the rest, no param_names."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95))


def write_nanogpt_ckpt(path: Path, iter_num: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A ckpt.pt as nanoGPT's train.py writes it: the compiled model's state dict (``_orig_mod.`` keys)."""
    torch.manual_seed(0)
    model = TinyGPT()
    compiled = compile_module(model)
    optimizer = nanogpt_optimizer(model)
    for _ in range(3):
        loss = model(torch.randint(0, 8, (2, 5))).logsumexp(-1).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    checkpoint = {
        "model": compiled.state_dict(),
        "optimizer": optimizer.state_dict(),
        "model_args": {"n_layer": 1, "n_embd": 4, "vocab_size": 8},
        "iter_num": iter_num,
        "best_val_loss": torch.tensor(2.25),
        "config": {"learning_rate": 6e-4, "compile": True, "out_dir": "out"},
    }
    assert all(key.startswith("_orig_mod.") for key in compiled.state_dict())
    torch.save(checkpoint, path)
    return model, optimizer


def test_a_nanogpt_checkpoint_converted_by_the_cli_continues_at_its_iter_num(tmp_path: Path, run: Run) -> None:
    saved_model, saved_opt = write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=250)
    folder = tmp_path / "run"

    code, out, err = run("convert", tmp_path / "ckpt.pt", "--into", folder)
    assert code == 0, err
    assert "ckpt_00000250.pt" in out and "step 250 (from key 'iter_num')" in out
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == ["ckpt_00000250.pt"]

    torch.manual_seed(1)  # other weights: the resume must bring the saved ones back
    model = TinyGPT()
    optimizer = nanogpt_optimizer(model)
    with dr.CheckpointManager(folder, model=model, optimizer=optimizer) as mgr:
        result = mgr.resume()
    assert result is not None and result.step == 250
    for (name, want), got in zip(saved_model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(want, got), name
    want_state, got_state = saved_opt.state_dict(), optimizer.state_dict()
    assert [g["weight_decay"] for g in got_state["param_groups"]] == [0.1, 0.0]
    for pid, state in want_state["state"].items():
        for key, value in state.items():
            assert torch.equal(value, got_state["state"][pid][key]), (pid, key)
    # the rest of nanoGPT's dict travels as extra
    assert result.extra["model_args"]["n_layer"] == 1 and float(result.extra["best_val_loss"]) == 2.25


def test_the_file_is_the_managers_format_without_prefixes(tmp_path: Path) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=7)
    result = tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "run")
    assert (result.step, result.step_from, result.prefix_before) == (7, "key 'iter_num'", "_orig_mod.")
    obj = torch.load(result.path, weights_only=True)
    assert obj["format"] == "dist_resume" and obj["meta"]["step"] == 7
    assert not any(k.startswith("_orig_mod.") for k in obj["model"])
    assert not (tmp_path / "run").joinpath(".ckpt_00000007.pt").exists()


def test_step_override_and_a_source_without_a_step(tmp_path: Path, run: Run) -> None:
    torch.save({"model": nn.Linear(2, 2).state_dict()}, tmp_path / "weights.pt")
    folder = tmp_path / "run"
    code, _, err = run("convert", tmp_path / "weights.pt", "--into", folder)
    assert code == 2 and "records no step" in err and "--step N" in err
    assert not folder.exists()  # refused before anything was created

    code, out, err = run("convert", tmp_path / "weights.pt", "--into", folder, "--step", "40", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["schema"] == "dist-resume/convert-into/1"
    assert (report["step"], report["step_from"], report["replaced"]) == (40, "--step", False)
    with dr.CheckpointManager(folder, model=nn.Linear(2, 2)) as mgr:
        resumed = mgr.resume()
    assert resumed is not None and resumed.step == 40


def test_own_files_keep_their_step_rng_and_data_position(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    dr.save_checkpoint(tmp_path / "snap.pt", model=model, step=12, epoch=3)
    result = tools.convert_into_folder(tmp_path / "snap.pt", tmp_path / "run")
    assert (result.step, result.epoch, result.layout.value) == (12, 3, "dist_resume")
    obj = torch.load(result.path, weights_only=True)
    assert obj["meta"]["epoch"] == 3 and "rng" in obj


def test_lightning_and_hf_steps_are_their_global_step(tmp_path: Path) -> None:
    inner = nn.Linear(2, 2)
    lightning = {
        "epoch": 1,
        "global_step": 64,
        "pytorch-lightning_version": "2.6.0",
        "state_dict": {f"model.{k}": v for k, v in inner.state_dict().items()},
        "optimizer_states": [torch.optim.SGD(inner.parameters(), lr=0.1).state_dict()],
        "lr_schedulers": [],
    }
    torch.save(lightning, tmp_path / "last.ckpt")
    result = tools.convert_into_folder(tmp_path / "last.ckpt", tmp_path / "run")
    assert (result.step, result.step_from, result.layout.value) == (64, "key 'global_step'", "lightning")


def test_later_checkpoints_are_refused_the_same_step_needs_force(tmp_path: Path, run: Run) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=100)
    folder = tmp_path / "run"
    with dr.CheckpointManager(folder, model=TinyGPT()) as mgr:
        mgr.save(200)
    code, _, err = run("convert", tmp_path / "ckpt.pt", "--into", folder)
    assert code == 2 and "after step 100" in err and "ckpt_00000200.pt" in err
    code, _, err = run("convert", tmp_path / "ckpt.pt", "--into", folder, "--force")
    assert code == 2 and "after step 100" in err  # --force never makes a checkpoint resume would not pick
    assert sorted(p.name for p in folder.glob("ckpt_*")) == ["ckpt_00000200.pt"]

    code, _, err = run("convert", tmp_path / "ckpt.pt", "--into", folder, "--step", "200")
    assert code == 2 and "holds a checkpoint of step 200 already" in err and "--force" in err
    before = (folder / "ckpt_00000200.pt").read_bytes()
    code, out, err = run("convert", tmp_path / "ckpt.pt", "--into", folder, "--step", "200", "--force")
    assert code == 0 and "replaced" in out, err
    assert (folder / "ckpt_00000200.pt").read_bytes() != before


def test_a_failed_write_leaves_no_new_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=5)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", fail)
    with pytest.raises(dr.errors.CheckpointWriteError):
        tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "run")
    assert not (tmp_path / "run").exists()
    (tmp_path / "kept").mkdir()
    with pytest.raises(dr.errors.CheckpointWriteError):
        tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "kept")
    assert (tmp_path / "kept").is_dir()  # a folder that was there stays


def test_a_live_writer_of_the_folder_is_refused(tmp_path: Path) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=5)
    with dr.CheckpointManager(tmp_path / "run", model=TinyGPT()) as mgr:
        assert mgr.resume() is None  # holds the folder's lock
        with pytest.raises(dr.errors.CheckpointWriteError, match="locked by"):
            tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "run")


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--force"], "not both"),  # with DST given as well, below
        (["--to", "ddp"], "--to ddp does not apply to --into"),
        (["--format", "safetensors"], "--format safetensors does not apply"),
    ],
)
def test_cli_usage_errors(tmp_path: Path, run: Run, extra: list[str], words: str) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=5)
    dst = [tmp_path / "dst.pt"] if words == "not both" else []
    code, _, err = run("convert", tmp_path / "ckpt.pt", *dst, "--into", tmp_path / "run", *extra)
    assert code == 2 and words in err
    assert not (tmp_path / "run").exists()


def test_cli_needs_dst_or_into_and_step_goes_with_into(tmp_path: Path, run: Run) -> None:
    torch.save({"w": torch.ones(1)}, tmp_path / "a.pt")
    code, _, err = run("convert", tmp_path / "a.pt", "--to", "ddp")
    assert code == 2 and "needs DST, or --into FOLDER" in err
    code, _, err = run("convert", tmp_path / "a.pt", tmp_path / "b.pt", "--step", "3")
    assert code == 2 and "--step applies to --into FOLDER only" in err


def test_a_foreign_folder_or_a_file_as_folder_is_refused(tmp_path: Path) -> None:
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", iter_num=5)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(dr.errors.NotACheckpointError, match="is a file, not a folder"):
        tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "file.txt")
    with pytest.raises(UsageError, match="non-negative"):
        tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "run", step=-1)
    assert not os.path.exists(tmp_path / "run")


def write_reference_ckpt(path: Path, epoch: int, model_key: str = "model", **more: Any) -> nn.Module:
    """A checkpoint as torchvision's classification reference saves it after epoch ``epoch`` (its save call,
    reproduced: torchvision is not installed next to CPU torch, FACTS 44); timm's CheckpointSaver keeps the model
    under ``model_key="state_dict"`` and adds ``more`` (``version``, ``arch``, ``metric``)."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 30)
    args = argparse.Namespace(lr=0.1, epochs=90, start_epoch=0, output_dir=str(path.parent))
    checkpoint = {
        model_key: model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "lr_scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "args": args,
        **more,
    }
    torch.save(checkpoint, path)
    return model


def test_torchvisions_finished_epoch_continues_at_the_next_and_says_so(tmp_path: Path, run: Run) -> None:
    # torchvision's --resume continues at checkpoint["epoch"] + 1: the converted run must not train epoch 4 again
    write_reference_ckpt(tmp_path / "checkpoint.pth", epoch=4)
    code, out, err = run("convert", tmp_path / "checkpoint.pth", "--into", tmp_path / "run")
    assert code == 0, err
    assert out.splitlines()[-1].endswith(
        "continues at step 0 (from the epoch: no step recorded, so 0 (--steps-per-epoch K: the epochs before it x "
        "K)), epoch 5 (from key 'epoch' 4 + 1: torchvision's epoch is the one it finished)"
    )
    code, out, err = run(
        "convert", tmp_path / "checkpoint.pth", "--into", tmp_path / "steps", "--steps-per-epoch", "100", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    assert (report["step"], report["epoch"]) == (500, 5)
    assert report["step_from"] == "the epoch: no step recorded, so 5 epochs x --steps-per-epoch 100"
    assert report["epoch_from"] == "key 'epoch' 4 + 1: torchvision's epoch is the one it finished"
    path = tmp_path / "steps" / "ckpt_00000500.pt"
    assert torch.load(path, weights_only=True)["extra"]["args"]["start_epoch"] == 0  # args as a plain dict
    with dr.CheckpointManager(tmp_path / "steps", model=nn.Linear(3, 2)) as mgr:
        resumed = mgr.resume()
    assert resumed is not None and (resumed.step, resumed.epoch) == (500, 5)
    code, _, err = run("convert", tmp_path / "checkpoint.pth", tmp_path / "out.pt", "--steps-per-epoch", "100")
    assert code == 2 and "--steps-per-epoch applies to --into FOLDER only" in err
    with pytest.raises(UsageError, match="positive int"):
        tools.convert_into_folder(tmp_path / "checkpoint.pth", tmp_path / "zero", steps_per_epoch=0)


def test_timms_epoch_is_finished_from_version_2_and_steps_are_taken_where_recorded(tmp_path: Path) -> None:
    timm: dict[str, Any] = {"model_key": "state_dict", "arch": "resnet50", "version": 2, "metric": 0.5}
    write_reference_ckpt(tmp_path / "last.pth.tar", epoch=7, **timm)
    result = tools.convert_into_folder(tmp_path / "last.pth.tar", tmp_path / "v2")
    assert (result.step, result.epoch) == (0, 8)
    assert result.epoch_from == "key 'epoch' 7 + 1: timm's epoch is the one it finished"
    write_reference_ckpt(tmp_path / "old.pth.tar", epoch=7, **{**timm, "version": 1})  # timm before version 2
    result = tools.convert_into_folder(tmp_path / "old.pth.tar", tmp_path / "v1")
    assert (result.epoch, result.epoch_from) == (7, "key 'epoch'")
    # a step the file records wins over --steps-per-epoch; a file without either is refused as before
    write_reference_ckpt(tmp_path / "stepped.pth", epoch=2, step=1234)
    result = tools.convert_into_folder(tmp_path / "stepped.pth", tmp_path / "s", steps_per_epoch=100)
    assert (result.step, result.step_from, result.epoch) == (1234, "key 'step'", 3)
    write_nanogpt_ckpt(tmp_path / "ckpt.pt", 40)
    nano = tools.convert_into_folder(tmp_path / "ckpt.pt", tmp_path / "n")  # iter_num, no epoch
    assert (nano.step, nano.epoch, nano.epoch_from) == (40, None, None)
