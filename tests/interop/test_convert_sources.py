"""convert: an HF Trainer folder and an Accelerate save_state folder, written by the libraries themselves, to one
dist_resume ``.pt`` that loads with plain ``torch.load(weights_only=True)`` and resumes like the folder did."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from tests.interop._compare import assert_same
from tests.interop.conftest import Saved


def _check(saved: Saved, dst: Path) -> dict:
    obj = torch.load(dst, weights_only=True, map_location="cpu")  # plain torch, nothing allowlisted
    assert obj["format"] == "dist_resume"
    assert_same(dict(obj["model"]), saved.model, "model")
    assert obj["optimizer"]["state"], "the optimizer state was dropped"
    return obj


def test_hf_trainer_folder_converts_to_one_pt(hf_checkpoint: Saved, tmp_path: Path) -> None:
    dst = tmp_path / "hf.pt"
    result = dr.tools.convert_checkpoint(hf_checkpoint.path, dst, format="pt")
    assert result.dst == dst and result.layout is dr.Layout.HF_TRAINER
    obj = _check(hf_checkpoint, dst)
    assert obj["meta"]["step"] == hf_checkpoint.step
    assert hf_checkpoint.optimizer is not None
    assert_same(obj["optimizer"]["state"], hf_checkpoint.optimizer["state"], "optimizer state")
    # the converted file resumes exactly as the folder does
    model = hf_checkpoint.extra["hf_model"].__class__(hf_checkpoint.extra["hf_model"].config)
    res = dr.resume(dst, model=model)
    assert res.step == hf_checkpoint.step and res.applied["model"][0] == len(hf_checkpoint.model)
    assert res.skipped == ("rng",)  # an HF folder holds no dist_resume RNG streams; neither does its conversion


def test_accelerate_folder_converts_the_first_model_and_optimizer(accelerate_state: Saved, tmp_path: Path) -> None:
    dst = tmp_path / "acc.pt"
    result = dr.tools.convert_checkpoint(accelerate_state.path, dst, format="pt")
    assert result.layout is dr.Layout.ACCELERATE
    obj = _check(accelerate_state, dst)
    assert accelerate_state.optimizer is not None
    assert_same(obj["optimizer"]["state"], accelerate_state.optimizer["state"], "optimizer state")


def test_convert_into_continues_an_hf_folder_where_hfs_resume_would(hf_checkpoint: Saved, tmp_path: Path) -> None:
    # 8 samples in batches of 4, 2 steps: trainer_state.json says epoch 1.0; HF resumes in epoch global_step // 2
    result = dr.tools.convert_into_folder(hf_checkpoint.path, tmp_path / "run")
    assert (result.step, result.step_from) == (2, "trainer_state.json 'global_step'")
    assert (
        result.epoch == 1
        and result.epoch_from is not None
        and result.epoch_from.startswith("trainer_state.json 'epoch' 1.0: the whole epochs done")
    )


def test_convert_into_takes_an_accelerate_folders_step_or_epoch_from_its_name(
    accelerate_state: Saved, tmp_path: Path
) -> None:
    # Accelerate's examples save_state into output_dir/epoch_{N} (N finished: they resume at N + 1) or step_{N}
    for name, (step, epoch) in {"epoch_3": (0, 4), "step_500": (500, None)}.items():
        shutil.copytree(accelerate_state.path, tmp_path / name)
        result = dr.tools.convert_into_folder(tmp_path / name, tmp_path / f"run-{name}")
        assert (result.step, result.epoch) == (step, epoch), name
    with pytest.raises(dr.errors.UsageError, match="records no step"):  # save_state's own name: no count in it
        dr.tools.convert_into_folder(accelerate_state.path, tmp_path / "run-state")


def test_convert_into_continues_a_lightning_ckpt_where_lightnings_resume_does(tmp_path: Path) -> None:
    # real Lightning: 3 steps an epoch, a checkpoint at the end of each epoch and one every 2 steps (mid-epoch, and at
    # an epoch's last batch); each is resumed by Lightning itself and converted: the first batch Lightning trains
    # after its resume is in the epoch, and at the step, the converted checkpoint continues at
    pl = pytest.importorskip("lightning.pytorch", reason="needs lightning (pip install dist-resume[interop])")
    from torch.utils.data import DataLoader, TensorDataset

    class Tiny(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Linear(4, 1)
            self.first: tuple[int, int] | None = None

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.model(batch[0]).square().sum()  # type: ignore[no-any-return]

        def on_train_batch_start(self, batch: Any, _: int) -> None:
            self.first = self.first or (self.trainer.current_epoch, self.trainer.global_step)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def fit(epochs: int, ckpt_path: Path | None = None) -> tuple[int, int] | None:
        module = Tiny()
        callbacks = [
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "ends", save_top_k=-1),
            pl.callbacks.ModelCheckpoint(dirpath=tmp_path / "steps", save_top_k=-1, every_n_train_steps=2),
        ]
        trainer = pl.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=callbacks if ckpt_path is None else [],
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(module, DataLoader(TensorDataset(torch.randn(12, 4)), batch_size=4), ckpt_path=ckpt_path)
        return module.first

    fit(2)
    cases = {
        "ends/epoch=0-step=3.ckpt": (1, 3),  # saved at epoch 0's end
        "steps/epoch=0-step=2.ckpt": (0, 2),  # mid-epoch
        "steps/epoch=1-step=6.ckpt": (2, 6),  # at epoch 1's last batch: Lightning counts the epoch as processed
    }
    for i, (name, (epoch, step)) in enumerate(cases.items()):
        assert fit(3, tmp_path / name) == (epoch, step), name
        result = dr.tools.convert_into_folder(tmp_path / name, tmp_path / f"run-{i}")
        assert (result.epoch, result.step, result.step_from) == (epoch, step, "key 'global_step'"), name
        assert result.epoch_from is not None and result.epoch_from.startswith("Lightning's fit loop"), name
