"""``dist-resume inspect`` on each foreign source, as the real libraries wrote it: words and ``--json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_resume.cli import main
from tests.interop.conftest import Saved


def _inspect(capsys: pytest.CaptureFixture[str], path: Path, *flags: str) -> str:
    code = main(["inspect", str(path), *flags])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def _report(capsys: pytest.CaptureFixture[str], path: Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(_inspect(capsys, path, "--json"))
    assert report["schema"] == "dist-resume/inspect/1"
    return report


def _line(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(label))


def test_hf_trainer_folder(hf_checkpoint: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    text = _inspect(capsys, hf_checkpoint.path)
    assert _line(text, "layout").split() == ["layout", "hf-trainer"]
    files = _line(text, "files")
    assert "model.safetensors" in files and "optimizer.pt" in files and "trainer_state.json" in files
    assert "training_args.bin: never unpickled" in text and "rng_state.pth: never unpickled" in text
    assert f"step={hf_checkpoint.step}" in _line(text, "meta")
    opt = _line(text, "optimizer")
    assert (
        "unknown class (AdamW-like: weight_decay, betas, eps)" in opt and "2 group(s)" in opt
    )  # HF does not store the class
    assert "scheduler: yes" in _line(text, "state")
    assert "not read (memory-mapped" in _line(text, "tensor data")

    report = _report(capsys, hf_checkpoint.path)
    assert report["layout"] == "hf-trainer" and report["archive"] is None
    assert {f["name"] for f in report["files"]} >= {"model.safetensors", "optimizer.pt", "scheduler.pt"}
    assert report["file_bytes"] == sum(f["size"] for f in report["files"])
    assert {e["name"] for e in report["not_read"]} == {"rng_state.pth", "training_args.bin"}
    model = report["model"]
    assert model["keys"] == len(hf_checkpoint.model) and model["prefix_style"] == "none"
    assert model["bytes"] == sum(t.numel() * t.element_size() for t in hf_checkpoint.model.values())
    saved = hf_checkpoint.optimizer
    assert saved is not None
    opt_report = report["optimizer"]
    assert opt_report["kind_from"] == "hyperparameters" and opt_report["param_groups"] == 2
    assert opt_report["params"] == sum(len(g["params"]) for g in saved["param_groups"])
    assert opt_report["params_with_state"] == len(saved["state"])
    assert {"exp_avg", "exp_avg_sq", "step"} <= set(opt_report["state_keys"])
    assert report["meta"]["step"] == hf_checkpoint.step and report["scheduler"] is True
    assert report["warnings"] == []


def test_hf_sharded_folder(hf_sharded: Path, hf_checkpoint: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    report = _report(capsys, hf_sharded)
    assert report["layout"] == "hf-trainer"
    names = {f["name"] for f in report["files"]}
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) > 1
    assert report["model"]["keys"] == len(hf_checkpoint.model) and report["optimizer"] is None
    text = _inspect(capsys, hf_sharded)
    assert "optimizer    none" in text and "model.safetensors.index.json" in _line(text, "files")


def test_accelerate_folder(accelerate_state: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    text = _inspect(capsys, accelerate_state.path)
    assert _line(text, "layout").split() == ["layout", "accelerate"]
    assert "optimizer.bin" in _line(text, "files")
    assert "random_states_0.pkl: never unpickled" in text
    assert "model_1.safetensors: not read: resume restores the first model only" in text
    assert "optimizer_1.bin: not read: resume restores the first optimizer only" in text
    report = _report(capsys, accelerate_state.path)
    assert report["model"]["keys"] == len(accelerate_state.model)
    assert report["optimizer"]["params"] == len(accelerate_state.model)  # AdamW over every parameter
    assert report["optimizer"]["kind"] == "AdamW" and report["optimizer"]["kind_from"] == "hyperparameters"
    assert report["scheduler"] is True and report["meta"]["step"] is None
    assert report["device_tags"] == {"cpu": report["device_tags"]["cpu"]}


@pytest.mark.parametrize("which", ["dcp_plain", "dcp_dsd"])
def test_dcp_folder(which: str, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str]) -> None:
    saved: Saved = request.getfixturevalue(which)
    text = _inspect(capsys, saved.path)
    assert _line(text, "layout").split() == ["layout", "dcp"]
    assert ".metadata" in _line(text, "files") and ".distcp" in _line(text, "files")
    assert "torch's DCP reader" in _line(text, "tensor data")
    report = _report(capsys, saved.path)
    assert report["model"]["keys"] == len(saved.model)
    assert report["optimizer"]["params_with_state"] == len(saved.model)  # every parameter trained
    assert report["warnings"] == []  # plain ids and DSD's names both fit the groups
    assert report["device_tags"] == {}  # DCP keeps no device tags; its .distcp files are not torch archives


def test_safetensors_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    safetensors_torch = pytest.importorskip("safetensors.torch", reason="needs safetensors")
    weights = {"module.fc.weight": torch.randn(3, 4), "module.fc.bias": torch.zeros(3, dtype=torch.float16)}
    path = tmp_path / "w.safetensors"
    safetensors_torch.save_file(weights, str(path))
    text = _inspect(capsys, path)
    assert _line(text, "layout").split() == ["layout", "safetensors"]
    assert "w.safetensors" in _line(text, "files") and "optimizer    none" in text
    assert "header only" in _line(text, "tensor data")
    report = _report(capsys, path)
    assert report["model"] == {
        "keys": 2,
        "tensors": 2,
        "bytes": 3 * 4 * 4 + 3 * 2,
        "prefix_style": "module.",
        "key_prefix": None,
        "first_keys": ["module.fc.weight", "module.fc.bias"],
        "class": None,
    }
    assert report["tensors"]["by_dtype"] == {
        "float16": {"count": 1, "bytes": 6},
        "float32": {"count": 1, "bytes": 48},
    }
    assert report["files"] == [{"name": "w.safetensors", "size": path.stat().st_size}]


def test_lightning_ckpt(lightning_ckpt: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    text = _inspect(capsys, lightning_ckpt.path)
    assert _line(text, "layout").split() == ["layout", "lightning"]
    assert f"step={lightning_ckpt.step}" in _line(text, "meta")
    report = _report(capsys, lightning_ckpt.path)
    assert report["files"] == [{"name": "last.ckpt", "size": lightning_ckpt.path.stat().st_size}]
    assert report["model"]["keys"] == len(lightning_ckpt.model) and report["scheduler"] is True
    assert report["model"]["key_prefix"] == "model."  # the LightningModule's self.model
    assert "key_prefix='model.' loads the inner module" in _line(text, "model")


def test_part_is_refused_for_a_foreign_source(hf_checkpoint: Saved, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["inspect", str(hf_checkpoint.path), "--part", "model=model"])
    assert code == 2 and "foreign source" in capsys.readouterr().err


def test_dcp_to_torch_save_output_gets_the_digit_string_warning(
    dcp_plain: Saved, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = tmp_path / "converted.pt"
    dcp_to_torch_save(str(dcp_plain.path), str(path))  # torch's own converter: state keys '0'..'3'
    report = _report(capsys, path)
    assert report["layout"] == "model+optimizer"
    (warning,) = [w for w in report["warnings"] if "digit strings" in w]
    assert "dist_resume's resume reads each digit string as the id it names" in warning
    assert report["optimizer"]["params_with_state"] == len(dcp_plain.model)
