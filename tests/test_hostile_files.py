"""Every reader over a tampered checkpoint file that is valid again as a zip (re-saved with ``torch.save``, so every
CRC-32 matches): a ``DistResumeError`` naming what is wrong, or the right answer; never a raw exception, nothing
changed by a resume that fails, and the CLI never says "internal error".

The tampering: a tensor that is not dense (sparse, nested, quantized, expanded, or a meta tensor without data) in the
model or the optimizer state, an optimizer group entry not named by a string, a format version from a newer
dist_resume, a model entry that is not a state dict; and a symlink loop given to ``convert``. The readers: ``resume``,
``CheckpointManager.resume``, ``tools.convert_checkpoint`` to every format, and ``dist-resume inspect``, ``verify``
and ``convert``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._checkpoint.plan.hparams import hparam_changes
from dist_resume.cli import main
from dist_resume.cli._common import ExitCode
from dist_resume.errors import (
    CheckpointCorruptError,
    DistResumeError,
    KeyMismatchError,
    NotACheckpointError,
    OptimizerStateMismatchError,
    StateMismatchError,
    UsageError,
)
from tests.models import TinyNet, assert_same, make_batches, snapshot, train_steps

KINDS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sparse_coo": lambda t: t.to_sparse(),
    "sparse_csr": lambda t: t.reshape(1, -1).to_sparse_csr(),
    "nested": lambda t: torch.nested.nested_tensor([t]),
    "quantized": lambda t: torch.quantize_per_tensor(t, 0.1, 0, torch.quint8),
    "meta": lambda t: t.to("meta"),
    "expanded": lambda t: t.reshape(-1)[:1].expand(t.shape),  # one stored number, every element on it
}
FORMATS = ("pt", "safetensors", "dcp", "sharded")


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # torch's own: nested tensors are a prototype, quantized ones lose a flag
        warnings.simplefilter("ignore", UserWarning)
        yield


def _objects(seed: int = 0) -> tuple[TinyNet, torch.optim.Optimizer]:
    model = TinyNet(seed)
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A manager folder holding one sound checkpoint, step 10."""
    out = tmp_path_factory.mktemp("hostile_files") / "ckpts"
    model, opt = _objects()
    train_steps(model, opt, make_batches(2))
    with dr.CheckpointManager(out, model=model, optimizer=opt) as mgr:
        mgr.save(10)
    return out


def _tampered(folder: Path, dst: Path, edit: Callable[[dict[str, Any]], object]) -> Path:
    """The step-10 checkpoint with ``edit`` applied, re-saved by torch (its CRCs valid) at ``dst``."""
    obj = torch.load(folder / "ckpt_00000010.pt", weights_only=True)
    edit(obj)
    dst.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, dst)
    return dst


def _model_entry(kind: str) -> Callable[[dict[str, Any]], object]:
    return lambda obj: obj["model"].__setitem__("head.bias", KINDS[kind](obj["model"]["head.bias"]))


def _optimizer_entry(kind: str) -> Callable[[dict[str, Any]], object]:
    def edit(obj: dict[str, Any]) -> None:
        state = obj["optimizer"]["state"]
        last = max(state)
        state[last]["exp_avg"] = KINDS[kind](state[last]["exp_avg"])

    return edit


def _refuses_without_change(path: Path, error: type[Exception], *words: str, **resume: Any) -> None:
    """``resume(path)`` raises ``error`` saying each of ``words``, and the live objects keep every byte."""
    model, opt = _objects(seed=1)
    before = snapshot(model, opt)
    with pytest.raises(error) as info:
        dr.resume(path, model=model, optimizer=opt, **resume)
    assert all(word in str(info.value) for word in words), (words, str(info.value))
    assert_same(snapshot(model, opt), before)


def _said(kind: str) -> str:
    """How a refusal names a tensor of ``kind``."""
    return {"meta": "meta tensors, without data", "expanded": "an expanded tensor"}.get(kind, f"a {kind} tensor")


def _cli(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_model_tensor_that_is_not_dense_is_refused_before_anything_changes(
    folder: Path, tmp_path: Path, kind: str
) -> None:
    path = _tampered(folder, tmp_path / "ckpt.pt", _model_entry(kind))
    error = StateMismatchError if kind == "meta" else KeyMismatchError  # meta: no stand-in, the file's own
    _refuses_without_change(path, error, "head.bias", _said(kind))
    _refuses_without_change(path, error, "head.bias", _said(kind), options=dr.ResumeOptions(verify=True))


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_optimizer_tensor_that_is_not_dense_is_refused_before_anything_changes(
    folder: Path, tmp_path: Path, kind: str
) -> None:
    path = _tampered(folder, tmp_path / "ckpt.pt", _optimizer_entry(kind))
    # meta: a stand-in until the data is needed; the others: refused by kind as the file is split, with the error
    # inspect_checkpoint (and so a folder's choice) gives the file, before any element is read
    error = StateMismatchError if kind == "meta" else NotACheckpointError
    _refuses_without_change(path, error, "['exp_avg']", _said(kind))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_reader_of_a_file_with_a_tensor_that_is_not_dense_answers_with_a_dist_resume_error(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    path = _tampered(folder, tmp_path / "ckpt.pt", _model_entry(kind))
    for fmt in FORMATS:  # meta: pt copies the file's structure as it is (no data to copy), safetensors writes none
        try:
            dr.tools.convert_checkpoint(path, tmp_path / f"out.{fmt}", format=fmt)
        except DistResumeError as refused:  # (a nested or quantized one is refused while data.pkl is read: unnamed)
            said = str(refused)
            assert "head.bias" in said or "a tensor kind that cannot be described" in said, (fmt, said)
        else:
            assert kind == "meta" and fmt in ("pt", "safetensors"), fmt
    for args in (
        ("inspect", path),
        ("verify", path, folder / "ckpt_00000010.pt"),
        *(("convert", path, tmp_path / f"cli.{fmt}", "--format", fmt, "--force") for fmt in FORMATS),
        ("convert", path, tmp_path / "ddp.pt", "--to", "ddp", "--force"),
    ):
        code, stderr = _cli(capsys, *args)
        assert code in (ExitCode.OK, ExitCode.DIFFERENT, ExitCode.INPUT), (args, stderr)
        assert "Traceback" not in stderr and "internal error" not in stderr, (args, stderr)
    code, _ = _cli(capsys, "verify", path, folder / "ckpt_00000010.pt")
    assert code == ExitCode.DIFFERENT  # the right answer: the two files differ there


def test_the_manager_skips_a_newest_file_holding_a_sparse_tensor(folder: Path, tmp_path: Path) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "ckpt_00000010.pt").write_bytes((folder / "ckpt_00000010.pt").read_bytes())
    _tampered(
        folder, ckpts / "ckpt_00000020.pt", lambda obj: (_model_entry("sparse_coo")(obj), obj["meta"].update(step=20))
    )
    model, opt = _objects(seed=1)
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt) as mgr:
        resumed = mgr.resume()
    assert resumed is not None and resumed.step == 10


def test_an_optimizer_group_entry_not_named_by_a_string_is_refused_before_anything_changes(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpts = tmp_path / "ckpts"
    path = _tampered(folder, ckpts / "ckpt_00000010.pt", lambda obj: obj["optimizer"]["param_groups"][0].update({5: 1}))
    _refuses_without_change(path, OptimizerStateMismatchError, "group 0 key 5")
    _refuses_without_change(path, OptimizerStateMismatchError, "group 0 key 5", options=dr.ResumeOptions(verify=True))
    model, opt = _objects(seed=1)
    before = snapshot(model, opt)
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt) as mgr:
        with pytest.raises(OptimizerStateMismatchError, match=r"group 0 key 5"):
            mgr.resume()
    assert_same(snapshot(model, opt), before)
    for args in (("inspect", path), ("verify", path, folder / "ckpt_00000010.pt")):
        code, err = _cli(capsys, *args)
        assert code in (ExitCode.OK, ExitCode.DIFFERENT) and "Traceback" not in err, (args, err)


def test_hyperparameter_changes_are_listed_whatever_the_groups_keys() -> None:
    saved: dict[Any, Any] = {5: 1, "lr": 0.1, "params": [0]}  # a damaged file's group: any key
    changes = hparam_changes([saved], [{"lr": 0.2, "params": [0]}])
    assert changes == [
        "group 0 5: checkpoint 1, this optimizer 'absent'",
        "group 0 lr: checkpoint 0.1, this optimizer 0.2",
    ]


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_symlink_loop_given_to_convert_is_a_usage_error_naming_it(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str
) -> None:
    loop = tmp_path / "ckpt_00000040.dcp"
    loop.symlink_to(loop.name)  # points to itself
    with pytest.raises(UsageError, match=r"SRC .*ckpt_00000040\.dcp.* cannot be resolved"):
        dr.tools.convert_checkpoint(loop, tmp_path / f"out.{fmt}", format=fmt)
    with pytest.raises(UsageError, match=r"DST .*ckpt_00000040\.dcp.* cannot be resolved"):
        dr.tools.convert_checkpoint(folder / "ckpt_00000010.pt", loop, format=fmt, force=True)
    code, err = _cli(capsys, "convert", loop, tmp_path / f"cli.{fmt}", "--format", fmt)
    assert code == ExitCode.INPUT and "ckpt_00000040.dcp" in err and "Traceback" not in err


def test_a_file_of_a_newer_format_version_is_refused_with_what_to_do(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newer = _tampered(folder, tmp_path / "newer.pt", lambda obj: obj.update(format_version=99))
    _refuses_without_change(newer, NotACheckpointError, "format version 99, written by a newer dist_resume", "upgrade")
    with pytest.raises(NotACheckpointError, match=r"format version 99"):
        dr.tools.inspect_checkpoint(newer)
    for fast in (True, False):  # verify's torch-free path hands it to the torch path, which says why
        code, err = _cli(
            capsys, "verify", newer, folder / "ckpt_00000010.pt", *(() if fast else ("--part", "model=model"))
        )
        assert code == ExitCode.INPUT and "upgrade" in err, err
    damaged = _tampered(folder, tmp_path / "damaged.pt", lambda obj: obj.update(format_version="1"))
    _refuses_without_change(damaged, NotACheckpointError, "'format_version' is '1', not a format version")
    unversioned = _tampered(folder, tmp_path / "unversioned.pt", lambda obj: obj.pop("format_version"))
    model, opt = _objects(seed=1)
    assert dr.resume(unversioned, model=model, optimizer=opt).step == 10  # read as version 1


def test_a_manager_folder_skips_a_newest_checkpoint_of_a_newer_format(
    folder: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    (ckpts / "ckpt_00000010.pt").write_bytes((folder / "ckpt_00000010.pt").read_bytes())
    _tampered(
        folder, ckpts / "ckpt_00000020.pt", lambda obj: (obj.update(format_version=2), obj["meta"].update(step=20))
    )
    assert dr.tools.latest_checkpoint(ckpts) == ckpts / "ckpt_00000010.pt"
    assert main(["list", str(ckpts)]) == ExitCode.OK  # its torch-free path hands the file to the torch path
    out = capsys.readouterr().out
    assert "resume would pick: ckpt_00000010.pt" in out and "format version 2" in out


def test_rotation_gives_no_keep_last_slot_to_a_file_whose_model_entry_is_not_a_state_dict(
    folder: Path, tmp_path: Path
) -> None:
    ckpts = tmp_path / "ckpts"
    model, opt = _objects()
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt, keep_last=10) as mgr:
        for step in (10, 20, 30):
            mgr.save(step)
    obj = torch.load(ckpts / "ckpt_00000030.pt", weights_only=True)
    obj["model"] = 0.5  # valid CRCs: torch.save writes them again
    torch.save(obj, ckpts / "ckpt_00000030.pt")
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt, keep_last=2) as mgr:
        mgr.save(40)
        assert sorted(p.name for p in ckpts.glob("ckpt_*")) == [
            "ckpt_00000020.pt",
            "ckpt_00000030.pt",  # left in place, named in the warning, takes no slot
            "ckpt_00000040.pt",
        ]
    (ckpts / "ckpt_00000040.pt").unlink()
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt) as mgr:
        resumed = mgr.resume()
    assert resumed is not None and resumed.step == 20


# ------------------------------------------------------------------ JSON a foreign checkpoint holds: unbounded numbers


def _hf_folder(tmp_path: Path, state: str) -> Path:
    """An HF Trainer ``checkpoint-20/``: TinyNet's weights as ``model.safetensors`` and ``trainer_state.json``
    holding ``state`` (JSON text)."""
    from safetensors.torch import save_file

    folder = tmp_path / "checkpoint-20"
    folder.mkdir()
    model, _ = _objects()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "trainer_state.json").write_text(state)
    return folder


@pytest.mark.parametrize(
    ("state", "step", "epoch"),
    [
        ('{"global_step": 20, "epoch": 1' + "0" * 400 + "}", 20, None),  # float() of it raised OverflowError
        ('{"global_step": 1' + "0" * 400 + ', "epoch": 1.5}', 20, 1),  # a step past int64: the folder name's
        ('{"global_step": 20, "epoch": NaN}', 20, None),
        ('{"global_step": 20, "epoch": -1e400}', 20, None),  # -inf
    ],
)
def test_an_hf_trainer_state_with_numbers_past_their_range_reads_without_them(
    tmp_path: Path, state: str, step: int, epoch: int | None
) -> None:
    folder = _hf_folder(tmp_path, state)
    assert dr.tools.inspect_checkpoint(folder).step == step
    loaded = dr.load_checkpoint(folder, map_location="cpu")
    assert loaded["step"] == step and loaded.get("epoch") == epoch


@pytest.mark.parametrize(
    "state",
    ['{"global_step": ' + "9" * 5000 + "}", "[" * 50_000 + "]" * 50_000],  # past int()'s 4,300 digits; nested deep
)
def test_an_hf_trainer_state_json_python_cannot_parse_is_a_damaged_file(tmp_path: Path, state: str) -> None:
    folder = _hf_folder(tmp_path, state)
    for read in (dr.tools.inspect_checkpoint, lambda p: dr.load_checkpoint(p, map_location="cpu")):
        with pytest.raises(CheckpointCorruptError, match=r"trainer_state\.json"):  # ValueError escaped
            read(folder)


@pytest.mark.parametrize(
    "header",
    [
        '{"w": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}',  # ValueError escaped
        '{"w": {"dtype": "F32", "shape": [' + "1" + "0" * 400 + ', 0], "data_offsets": [0, 0]}}',  # past int64
        '{"w": ' + "[" * 50_000 + "]" * 50_000 + "}",  # RecursionError escaped
    ],
)
def test_a_safetensors_header_python_cannot_parse_or_torch_cannot_hold_is_refused(tmp_path: Path, header: str) -> None:
    raw = header.encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"\0" * 4)
    for read in (dr.tools.inspect_checkpoint, dr.tools.verify_archive, lambda p: dr.load_checkpoint(p)):
        with pytest.raises(CheckpointCorruptError, match=r"model\.safetensors"):
            read(path)
