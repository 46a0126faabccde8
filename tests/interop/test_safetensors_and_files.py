"""A single .safetensors file (torch-only reader, the package as cross-check), Lightning and script-style files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._core.errors import CheckpointCorruptError
from dist_resume._foreign.safetensors_read import is_safetensors, read_safetensors
from dist_resume._layout.layout import split_checkpoint
from dist_resume._source.open import load_checkpoint
from tests.interop._compare import assert_same
from tests.interop.conftest import Saved


def _mixed() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(2, dtype=torch.float16),
        "d": torch.tensor([True, False]),
        "e": torch.randn(7).to(torch.bfloat16),
        "empty": torch.empty(0, 3),
    }


@pytest.mark.parametrize("mmap", [True, False])
def test_reader_matches_the_safetensors_package(tmp_path: Path, mmap: bool) -> None:
    st = pytest.importorskip("safetensors.torch", reason="needs safetensors (pip install dist-resume[safetensors])")
    tensors = _mixed()
    st.save_file(tensors, tmp_path / "w.safetensors", metadata={"format": "pt"})
    got, meta = read_safetensors(tmp_path / "w.safetensors", map_location="cpu", mmap=mmap)
    assert_same(got, st.load_file(tmp_path / "w.safetensors"))
    assert_same(got, tensors)
    assert meta == {"format": "pt"} and is_safetensors(tmp_path / "w.safetensors")


def test_hf_model_safetensors_reads_the_trainer_weights(hf_checkpoint: Saved) -> None:
    got, _ = read_safetensors(hf_checkpoint.path / "model.safetensors", map_location="cpu")
    assert_same(got, hf_checkpoint.model)


def _write(path: Path, header: object, data: bytes, length: int | None = None) -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes((len(raw) if length is None else length).to_bytes(8, "little") + raw + data)
    return path


@pytest.mark.parametrize(
    ("header", "data", "length", "match"),
    [
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4, None, "spans bytes 0..8 of 4"),
        ({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 8, None, "it needs 8"),
        ({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, None, "shape"),
        (
            {
                "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "v": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
            },
            b"\0" * 8,
            None,
            "overlap",
        ),
        ({}, b"", 10**9, "header claims"),
        ({"w": {"dtype": "F32"}}, b"", None, "lacks dtype"),
    ],
)
def test_lengths_and_offsets_are_checked_against_the_file(
    tmp_path: Path, header: object, data: bytes, length: int | None, match: str
) -> None:
    path = _write(tmp_path / "bad.safetensors", header, data, length)
    with pytest.raises(CheckpointCorruptError, match=match):
        read_safetensors(path, map_location="cpu")


def test_lightning_ckpt_splits_into_its_parts(lightning_ckpt: Saved) -> None:
    obj = load_checkpoint(lightning_ckpt.path, map_location="cpu")
    assert {"state_dict", "optimizer_states", "lr_schedulers", "pytorch-lightning_version"} <= set(obj)
    parts = split_checkpoint(obj)
    assert_same({k.removeprefix("model."): v for k, v in parts.model.items()}, lightning_ckpt.model, "model")
    assert all(k.startswith("model.") for k in parts.model)  # the LightningModule attribute prefix (FACTS 18)
    assert_same(parts.optimizer, lightning_ckpt.optimizer, "optimizer")
    assert_same(parts.scheduler, lightning_ckpt.scheduler, "scheduler")
    assert parts.step == lightning_ckpt.step


def test_torchvision_timm_style_file_keeps_args_and_ema(torchvision_timm_file: Saved) -> None:
    obj = load_checkpoint(torchvision_timm_file.path, map_location="cpu")  # argparse.Namespace is allowed
    parts = split_checkpoint(obj)
    assert_same(dict(parts.model), torchvision_timm_file.model, "model")
    assert_same(parts.optimizer, torchvision_timm_file.optimizer, "optimizer")
    assert_same(parts.scheduler, torchvision_timm_file.scheduler, "scheduler")
    assert parts.epoch == 1 and len(parts.optimizer["param_groups"]) == 2
    assert parts.extra["args"] == torchvision_timm_file.extra["args"]
    # the detector takes the first conventional EMA name (torchvision's model_ema); timm's copy stays in extra
    assert_same(dict(parts.ema), torchvision_timm_file.extra["ema"], "model_ema")
    assert "n_averaged" in parts.ema and "state_dict_ema" in parts.extra and parts.keys["ema"] == "model_ema"


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "module."])
def test_torchvision_timm_style_file_resumes_with_its_ema(torchvision_timm_file: Saved, wrap: bool) -> None:
    """model, AdamW's two groups, StepLR, epoch, args and the AveragedModel EMA (with n_averaged), into a plain
    model and a DDP-shaped one (DataParallel gives the same ``module.`` keys on a CPU)."""
    from torch.optim.swa_utils import AveragedModel

    from tests.interop.conftest import _tiny

    inner = _tiny()
    model = torch.nn.DataParallel(inner) if wrap else inner
    decay = [p for n, p in inner.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in inner.named_parameters() if not n.endswith("weight")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05}, {"params": no_decay, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    ema = AveragedModel(_tiny())
    res = dr.resume(torchvision_timm_file.path, model=model, optimizer=opt, scheduler=sched, ema=ema)
    assert {"model", "optimizer", "scheduler", "ema"} <= set(res.restored)
    assert res.epoch == 1 and res.extra["args"] == torchvision_timm_file.extra["args"]
    assert_same(inner.state_dict(), torchvision_timm_file.model, "model")
    assert_same(ema.state_dict(), torchvision_timm_file.extra["ema"], "ema")  # n_averaged included
    assert torchvision_timm_file.optimizer is not None
    assert_same(opt.state_dict()["state"], torchvision_timm_file.optimizer["state"], "optimizer state")
    assert sched.state_dict() == torchvision_timm_file.scheduler
