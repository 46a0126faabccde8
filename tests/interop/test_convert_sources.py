"""convert: an HF Trainer folder and an Accelerate save_state folder, written by the libraries themselves, to one
dist_resume ``.pt`` that loads with plain ``torch.load(weights_only=True)`` and resumes like the folder did."""

from __future__ import annotations

from pathlib import Path

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
