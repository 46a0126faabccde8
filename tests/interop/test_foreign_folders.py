"""HF Trainer and Accelerate folders, read as their libraries wrote them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from dist_resume._core.errors import CheckpointCorruptError, NotACheckpointError
from dist_resume._foreign.folders import FolderKind, detect_folder, read_foreign_folder
from tests.interop._compare import assert_same, loads_into
from tests.interop.conftest import Saved


def test_hf_trainer_checkpoint_reads_what_trainer_saved(hf_checkpoint: Saved) -> None:
    assert detect_folder(hf_checkpoint.path) is FolderKind.HF_TRAINER
    parts = read_foreign_folder(hf_checkpoint.path, map_location="cpu")
    assert_same(dict(parts.model), hf_checkpoint.model, "model")
    assert_same(parts.optimizer, hf_checkpoint.optimizer, "optimizer")
    assert_same(parts.scheduler, hf_checkpoint.scheduler, "scheduler")
    assert (parts.step, parts.epoch) == (hf_checkpoint.step, hf_checkpoint.epoch)
    assert len(parts.optimizer["param_groups"]) == 2  # decay / no-decay
    assert set(parts.meta["skipped_files"]) == {"rng_state.pth", "training_args.bin"}
    assert parts.layout.value == "hf-trainer"


def test_hf_trainer_state_loads_into_a_fresh_model_and_optimizer(hf_checkpoint: Saved) -> None:
    from transformers import BertForSequenceClassification

    parts = read_foreign_folder(hf_checkpoint.path, map_location="cpu")
    model = BertForSequenceClassification(hf_checkpoint.extra["hf_model"].config)
    model.load_state_dict(parts.model)
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "LayerNorm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    optimizer = torch.optim.AdamW([{"params": decay}, {"params": rest}])
    loads_into(optimizer, parts.optimizer)


def test_hf_sharded_safetensors_equal_the_single_file(hf_checkpoint: Saved, hf_sharded: Path) -> None:
    assert (hf_sharded / "model.safetensors.index.json").is_file()
    assert len(list(hf_sharded.glob("model-*-of-*.safetensors"))) > 1
    parts = read_foreign_folder(hf_sharded, map_location="cpu")
    assert_same(dict(parts.model), hf_checkpoint.model, "model")
    assert parts.optimizer is None and parts.step is None


def test_hf_pytorch_model_bin_and_its_sharded_index(hf_checkpoint: Saved, tmp_path: Path) -> None:
    # pytorch_model.bin as older transformers wrote it: torch.save(state_dict), plus the index form
    single = tmp_path / "single"
    single.mkdir()
    torch.save(hf_checkpoint.model, single / "pytorch_model.bin")
    shutil.copy(hf_checkpoint.path / "optimizer.pt", single / "optimizer.pt")
    assert_same(dict(read_foreign_folder(single, map_location="cpu").model), hf_checkpoint.model, "model")
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    keys = list(hf_checkpoint.model)
    halves = {"pytorch_model-00001-of-00002.bin": keys[:5], "pytorch_model-00002-of-00002.bin": keys[5:]}
    for name, part in halves.items():
        torch.save({k: hf_checkpoint.model[k] for k in part}, sharded / name)
    index = {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}
    (sharded / "pytorch_model.bin.index.json").write_text(__import__("json").dumps(index))
    assert_same(dict(read_foreign_folder(sharded, map_location="cpu").model), hf_checkpoint.model, "model")


def test_hf_index_naming_a_missing_or_escaping_shard_is_refused(hf_sharded: Path, tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(hf_sharded, broken)
    next(broken.glob("model-00001-*.safetensors")).unlink()
    with pytest.raises(CheckpointCorruptError, match="names shards that are not files"):
        read_foreign_folder(broken, map_location="cpu")
    escaping = tmp_path / "escaping"
    shutil.copytree(hf_sharded, escaping)
    (escaping / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../x.safetensors"}}')
    with pytest.raises(CheckpointCorruptError, match=r"\.\./x\.safetensors"):
        read_foreign_folder(escaping, map_location="cpu")


def test_accelerate_save_state_reads_the_first_model_and_names_the_others(accelerate_state: Saved) -> None:
    assert detect_folder(accelerate_state.path) is FolderKind.ACCELERATE
    parts = read_foreign_folder(accelerate_state.path, map_location="cpu")
    assert_same(dict(parts.model), accelerate_state.model, "model")
    assert_same(parts.optimizer, accelerate_state.optimizer, "optimizer")
    assert_same(parts.scheduler, accelerate_state.scheduler, "scheduler")
    assert parts.meta["more_models"] == ["model_1.safetensors"]
    assert parts.meta["more_optimizers"] == ["optimizer_1.bin"]
    assert parts.meta["skipped_files"] == ["random_states_0.pkl"]
    assert parts.layout.value == "accelerate"


def test_random_states_pickle_is_never_opened(accelerate_state: Saved, tmp_path: Path) -> None:
    folder = tmp_path / "state"
    shutil.copytree(accelerate_state.path, folder)
    (folder / "random_states_0.pkl").write_bytes(b"not a pickle at all")  # would fail if unpickled
    (folder / "random_states_0.pkl").chmod(0)
    assert_same(dict(read_foreign_folder(folder, map_location="cpu").model), accelerate_state.model, "model")


def test_checkpoint_manager_folder_keeps_priority(hf_checkpoint: Saved, tmp_path: Path) -> None:
    folder = tmp_path / "mixed"
    shutil.copytree(hf_checkpoint.path, folder)
    assert detect_folder(folder) is FolderKind.HF_TRAINER
    torch.save({}, folder / "ckpt_00000100.pt")
    assert detect_folder(folder) is None


def test_unknown_folder_lists_its_files_and_the_known_kinds(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    assert detect_folder(tmp_path) is None
    with pytest.raises(NotACheckpointError, match=r"'notes.txt'.*HF Trainer.*Accelerate.*DCP"):
        read_foreign_folder(tmp_path)
