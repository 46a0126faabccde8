"""resume() from each foreign source into a plain and a DataParallel-wrapped (``module.``) model.

Every source is written by its library's own save code (fixtures in conftest.py); what comes back is
compared with what the library held when it saved: weights, optimizer state (exp_avg etc.), scheduler.
"""

from __future__ import annotations

import logging
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._layout.layout import split_checkpoint
from tests.interop._compare import assert_same
from tests.interop.conftest import Saved, _tiny


@dataclass
class Case:
    saved: Saved
    layout: str
    model: Callable[[], nn.Module]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None
    scheduler: Callable[[torch.optim.Optimizer], Any] | None = None


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step_lr(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)


def _hf_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    # transformers' Trainer: decay / no-decay groups (bias and LayerNorm weights get no decay)
    decay = [p for n, p in model.named_parameters() if "bias" not in n and "LayerNorm" not in n]
    rest = [p for n, p in model.named_parameters() if "bias" in n or "LayerNorm" in n]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}])


class _LitLike(nn.Module):
    """The LightningModule's attribute layout (``self.model``), without Lightning."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _tiny()


def _case(name: str, request: pytest.FixtureRequest) -> Case:
    if name in ("hf", "hf-sharded", "safetensors"):
        hf: Saved = request.getfixturevalue("hf_checkpoint")
        config = hf.extra["hf_model"].config

        def bert() -> nn.Module:
            from transformers import BertForSequenceClassification

            return BertForSequenceClassification(config)

        if name == "hf":
            return Case(hf, "hf-trainer", bert, _hf_optimizer, lambda o: torch.optim.lr_scheduler.LambdaLR(o, _one))
        if name == "hf-sharded":
            return Case(Saved(request.getfixturevalue("hf_sharded"), hf.model), "hf-trainer", bert)
        return Case(Saved(hf.path / "model.safetensors", hf.model), "safetensors", bert)
    if name == "accelerate":
        return Case(request.getfixturevalue("accelerate_state"), "accelerate", _tiny, _adamw, _step_lr)
    if name in ("dcp-plain", "dcp-dsd"):
        return Case(request.getfixturevalue(name.replace("-", "_")), "dcp", _tiny, _adamw)
    assert name == "lightning"
    return Case(request.getfixturevalue("lightning_ckpt"), "lightning", _LitLike, _adamw, _step_lr)


def _one(_: int) -> float:
    return 1.0


SOURCES = ["hf", "hf-sharded", "accelerate", "dcp-plain", "dcp-dsd", "lightning", "safetensors"]


def _inner(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.DataParallel) else model


def _fresh(case: Case, wrap: bool) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    torch.manual_seed(123)  # different from what was saved
    model = case.model()
    if wrap:
        model = nn.DataParallel(model)  # CPU: keys get module., like DDP
    opt = case.optimizer(model) if case.optimizer else None
    sched = case.scheduler(opt) if case.scheduler and opt is not None else None
    return model, opt, sched


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "module."])
@pytest.mark.parametrize("name", SOURCES)
def test_resume_restores_what_the_library_saved(name: str, wrap: bool, request: pytest.FixtureRequest) -> None:
    case = _case(name, request)
    model, opt, sched = _fresh(case, wrap)
    result = dr.resume(
        case.saved.path, model=model, optimizer=opt, scheduler=sched, options=dr.ResumeOptions(map_location="cpu")
    )
    assert result.layout.value == case.layout
    want_model = {k: v for k, v in case.saved.model.items()}
    if name == "lightning":
        want_model = {f"model.{k}": v for k, v in want_model.items()}
    assert_same(_inner(model).state_dict(), want_model, "model")
    expected = ("model",) + (("optimizer",) if opt else ()) + (("scheduler",) if sched else ())
    assert result.restored == expected
    if opt is not None:
        assert case.saved.optimizer is not None
        assert_same(opt.state_dict()["state"], case.saved.optimizer["state"], "optimizer state")
        assert all(opt.state[p] for g in opt.param_groups for p in g["params"]), "a parameter got no state"
        _loss(model, name).backward()  # the restored state works
        opt.step()
    if sched is not None and case.saved.scheduler is not None:
        assert sched.last_epoch == case.saved.scheduler["last_epoch"]
    if name == "hf":
        assert (result.step, result.epoch) == (2, 1)
        assert set(result.metadata["skipped_files"]) == {"rng_state.pth", "training_args.bin"}


def _loss(model: nn.Module, name: str) -> torch.Tensor:
    if name == "hf":
        return model(torch.randint(0, 32, (2, 6))).logits.sum()  # type: ignore[no-any-return]
    if name == "lightning":
        module = _inner(model).model  # the LightningModule's network
        assert isinstance(module, nn.Module)
        return module(torch.randn(3, 4)).sum()
    return model(torch.randn(3, 4)).sum()  # type: ignore[no-any-return]


def test_resume_with_broadcast_flag_outside_torchrun_reads_the_folder(dcp_dsd: Saved) -> None:
    model = _tiny()
    opt = _adamw(model)
    result = dr.resume(dcp_dsd.path, model=model, optimizer=opt, options=dr.ResumeOptions(broadcast_from_rank0=True))
    assert result.layout.value == "dcp"
    assert_same(opt.state_dict()["state"], dcp_dsd.optimizer["state"], "optimizer state")  # type: ignore[index]


def test_safetensors_has_no_optimizer_and_says_what_to_do(hf_checkpoint: Saved) -> None:
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification(hf_checkpoint.extra["hf_model"].config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = _hf_optimizer(model)
    with pytest.raises(
        dr.errors.StateMismatchError, match=r"safetensors layout\) has no optimizer state.*optimizer"
    ) as info:
        dr.resume(hf_checkpoint.path / "model.safetensors", model=model, optimizer=opt)
    assert "do not pass the optimizer" in str(info.value) or "allow_missing" in str(info.value)
    assert_same(model.state_dict(), before, "model after a refused resume")  # all or nothing


def test_accelerate_with_several_models_logs_that_only_the_first_is_restored(
    accelerate_state: Saved, caplog: pytest.LogCaptureFixture
) -> None:
    model = _tiny()
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        dr.resume(accelerate_state.path, model=model, options=dr.ResumeOptions(map_location="cpu", strict=False))
    assert any(
        "more than one model" in r.getMessage() and "model_1.safetensors" in r.getMessage() for r in caplog.records
    )


def test_load_checkpoint_of_a_foreign_source_is_a_dict_split_checkpoint_reads(hf_checkpoint: Saved) -> None:
    obj = dr.load_checkpoint(hf_checkpoint.path, map_location="cpu")
    assert set(obj) == {"model", "optimizer", "scheduler", "step", "epoch", "meta"}
    assert obj["meta"]["source_layout"] == "hf-trainer"
    parts = split_checkpoint(obj)
    assert_same(dict(parts.model), hf_checkpoint.model, "model")
    assert_same(parts.optimizer, hf_checkpoint.optimizer, "optimizer")
    assert (parts.step, parts.epoch) == (2, 1)
    weights = dr.load_checkpoint(hf_checkpoint.path / "model.safetensors", map_location="cpu")
    assert set(weights) == {"model", "meta"}
    assert_same(weights["model"], hf_checkpoint.model)


def test_unrecognised_and_manager_folders_are_refused_by_load_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(dr.errors.NotACheckpointError, match=r"'notes.txt'.*hf-trainer.*accelerate.*dcp"):
        dr.load_checkpoint(tmp_path)
    manager = tmp_path / "run"
    dr.CheckpointManager(manager).save(3, model=nn.Linear(2, 2))
    with pytest.raises(dr.errors.CheckpointNotFoundError, match="folder"):
        dr.load_checkpoint(manager)


def test_inspect_and_verify_a_foreign_folder(hf_checkpoint: Saved, tmp_path: Path) -> None:
    info = dr.tools.inspect_checkpoint(hf_checkpoint.path)
    names = dict(info.files)
    assert info.layout == "hf-trainer" and info.step == 2
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt"} <= set(names)
    assert info.size == sum(names.values())
    assert dr.tools.verify_archive(hf_checkpoint.path) == []
    copy = tmp_path / "checkpoint-2"
    shutil.copytree(hf_checkpoint.path, copy)
    assert dr.tools.inspect_checkpoint(copy).digest == info.digest
    _flip_last_tensor_byte(copy / "optimizer.pt")
    findings = dr.tools.verify_archive(copy, strict=False)
    assert findings and findings[0].record is not None and findings[0].record.startswith("optimizer.pt")
    with pytest.raises(dr.errors.CheckpointCorruptError, match=r"optimizer\.pt"):
        dr.resume(copy, model=_tiny(), options=dr.ResumeOptions(verify=True))


def test_verify_checks_the_safetensors_header(hf_checkpoint: Saved, tmp_path: Path) -> None:
    st = tmp_path / "model.safetensors"
    shutil.copy(hf_checkpoint.path / "model.safetensors", st)
    assert dr.tools.verify_archive(st) == []
    assert dr.tools.inspect_checkpoint(st).layout == "safetensors"
    with open(st, "r+b") as f:
        f.truncate(st.stat().st_size - 4)
    with pytest.raises(dr.errors.CheckpointCorruptError, match="spans bytes"):
        dr.tools.verify_archive(st)


def _flip_last_tensor_byte(path: Path) -> None:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        offset = info.header_offset + 30 + name_len + extra_len
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_cli_verify_compares_a_foreign_folder_with_a_torch_file(hf_checkpoint: Saved, tmp_path: Path) -> None:
    from dist_resume.cli._verify import verify_checkpoints

    assert hf_checkpoint.optimizer is not None
    same = tmp_path / "same.pt"
    torch.save(
        {"model": {f"module.{k}": v for k, v in hf_checkpoint.model.items()}, "optimizer": hf_checkpoint.optimizer},
        same,
    )
    report = verify_checkpoints(hf_checkpoint.path, same)
    assert report["equal"], report["differences"]
    assert report["a"]["layout"] == "hf-trainer" and report["compared"]["optimizer_tensors"] > 0
    other = dict(hf_checkpoint.model)
    key = next(iter(other))
    other[key] = other[key] + 1
    torch.save({"model": other, "optimizer": hf_checkpoint.optimizer}, tmp_path / "other.pt")
    report = verify_checkpoints(hf_checkpoint.path, tmp_path / "other.pt")
    assert not report["equal"] and report["differences"][0]["key"] == key


def test_the_parent_of_checkpoint_folders_names_them_and_is_never_a_first_run(
    hf_checkpoint: Saved, capsys: pytest.CaptureFixture[str]
) -> None:
    # an HF Trainer output_dir holds checkpoint-N/: resuming from it is a wrong path, and code that
    # catches CheckpointNotFoundError to start fresh must not throw the run away
    from dist_resume.cli import main

    output_dir = hf_checkpoint.path.parent
    model = _tiny()
    calls: list[Callable[[], Any]] = [
        lambda: dr.resume(output_dir, model=model),
        lambda: dr.load_checkpoint(output_dir),
        lambda: dr.CheckpointManager(output_dir).resume(model=model),
    ]
    for call in calls:
        with pytest.raises(dr.errors.NotACheckpointError, match="checkpoint-2/") as err:
            call()
        assert not isinstance(err.value, dr.errors.CheckpointNotFoundError)
        assert repr(str(hf_checkpoint.path)) in str(err.value)  # names the folder to pass
    for argv in (["inspect", str(output_dir)], ["convert", str(output_dir), str(output_dir / "x.pt"), "--to", "ddp"]):
        assert main(argv) == 2
        assert "checkpoint-2/" in capsys.readouterr().err
    with pytest.raises(dr.errors.NotACheckpointError, match="itself a checkpoint"):
        dr.CheckpointManager(hf_checkpoint.path).resume(model=model)  # would save ckpt_*.pt into the HF folder


@pytest.mark.parametrize("wrap", [False, True], ids=["plain", "wrapped"])
def test_a_real_lightning_ckpt_resumes_into_the_inner_module_with_key_prefix(lightning_ckpt: Saved, wrap: bool) -> None:
    inner = _tiny()
    target: nn.Module = nn.DataParallel(inner) if wrap else inner  # DataParallel: DDP's module. keys, one process
    opt = torch.optim.AdamW(inner.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    with pytest.raises(dr.errors.KeyMismatchError, match=r"key_prefix='model\.'"):
        dr.resume(
            lightning_ckpt.path, model=target, options=dr.ResumeOptions(strict=False)
        )  # nothing fits without the prefix: never 0 of N
    result = dr.resume(
        lightning_ckpt.path, model=target, optimizer=opt, scheduler=sched, options=dr.ResumeOptions(key_prefix="model.")
    )
    assert result.layout is dr.Layout.LIGHTNING and result.step == 2
    assert result.restored == ("model", "optimizer", "scheduler")
    assert result.applied["model"] == (len(lightning_ckpt.model), len(lightning_ckpt.model))
    assert_same(dict(inner.state_dict()), lightning_ckpt.model, "model")
    assert lightning_ckpt.optimizer is not None
    assert_same(opt.state_dict()["state"], lightning_ckpt.optimizer["state"], "optimizer state")
    assert sched.state_dict()["last_epoch"] == lightning_ckpt.scheduler["last_epoch"]  # type: ignore[index]
