"""``dist-resume list`` and ``verify`` without torch: the fast paths give the torch paths' reports on a corpus
(folders sound, damaged, renamed, foreign, sharded; pairs of files equal, different, prefixed, strided, damaged,
foreign), never import torch for sound checkpoints of this toolkit, and the stub reader is unsure of anything
torch.save does not write for a state dict; ``import dist_resume`` imports no torch."""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.peek import PeekUnsure, TensorStub, peek_archive
from dist_resume._layout.layout import FORMAT_NAME, FORMAT_VERSION, Key, describe_keys
from dist_resume._source.listing import CHECKPOINT_NAME, checkpoint_name, sharded_checkpoint_name
from dist_resume._state.optim.keys import GROUP_BOOKKEEPING
from dist_resume._state.prefix import canonical_key, prefix_style
from dist_resume.cli import _fast, _fast_verify
from dist_resume.cli._list import list_folder
from dist_resume.cli._verify import render_verify, verify_checkpoints
from dist_resume.errors import DistResumeError

REPO = Path(__file__).resolve().parents[1]


def _flip_tensor_byte(path: Path) -> None:
    with zipfile.ZipFile(path) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename and i.file_size > 0)
    raw = bytearray(path.read_bytes())
    name_len = int.from_bytes(raw[info.header_offset + 26 : info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    raw[info.header_offset + 30 + name_len + extra_len] ^= 0xFF
    path.write_bytes(bytes(raw))


def _sound(folder: Path, steps: tuple[int, ...] = (10, 20)) -> Path:
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    with dr.CheckpointManager(folder, model=model, optimizer=opt, scheduler=sched, keep_last=5) as mgr:
        for step in steps:
            mgr.save(step, epoch=step // 10, extra={"note": "x", "lr": 0.5})
    return folder


def _sharded(folder: Path, step: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    src = dr.save_checkpoint(folder.parent / f"src_{step}.pt", model=nn.Linear(4, 4), step=step, epoch=2)
    dr.tools.convert_checkpoint(src, folder / sharded_checkpoint_name(step), format="sharded")
    src.unlink()
    return folder


def _corpus(root: Path) -> dict[str, Path]:
    """Folders of every kind ``list`` meets, by name; the ones marked fast are answered without torch."""
    c = {"sound": _sound(root / "sound"), "sharded": _sharded(_sound(root / "mixed", (10,)), 20)}
    c["flipped newest"] = _sound(root / "flipped")
    _flip_tensor_byte(c["flipped newest"] / checkpoint_name(20))
    c["flipped oldest"] = _sound(root / "flipped_old")
    _flip_tensor_byte(c["flipped oldest"] / checkpoint_name(10))
    c["truncated"] = _sound(root / "truncated")
    data = (c["truncated"] / checkpoint_name(20)).read_bytes()
    (c["truncated"] / checkpoint_name(20)).write_bytes(data[: len(data) // 2])
    c["renamed"] = _sound(root / "renamed")
    (c["renamed"] / checkpoint_name(20)).rename(c["renamed"] / checkpoint_name(30))
    c["foreign file"] = root / "foreign"
    c["foreign file"].mkdir()
    torch.save({"model": nn.Linear(2, 2).state_dict()}, c["foreign file"] / checkpoint_name(5))
    c["namespace"] = root / "namespace"
    c["namespace"].mkdir()
    torch.save({"args": argparse.Namespace(lr=1)}, c["namespace"] / checkpoint_name(5))
    c["leftovers"] = _sound(root / "leftovers")
    (c["leftovers"] / f".{checkpoint_name(30)}.0123456789abcdef.tmp").write_bytes(b"PK")
    (c["leftovers"] / "notes.txt").write_text("x")
    c["damaged shard"] = _sharded(root / "damaged_shard", 20)
    shard = next((c["damaged shard"] / sharded_checkpoint_name(20)).glob("*.distcp"))
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    shard.write_bytes(bytes(raw))
    c["missing manifest"] = _sharded(root / "no_manifest", 20)
    (c["missing manifest"] / sharded_checkpoint_name(20) / "manifest.json").unlink()
    c["empty"] = root / "empty"
    c["empty"].mkdir()
    c["hf"] = root / "hf"
    (c["hf"] / "checkpoint-7").mkdir(parents=True)
    (c["hf"] / "checkpoint-7" / "trainer_state.json").write_text('{"global_step": 7, "epoch": 1.0}')
    torch.save({}, c["hf"] / "checkpoint-7" / "optimizer.pt")
    return c


FAST = {"sound", "sharded", "leftovers"}


def _without_ages(report: dict[str, Any]) -> dict[str, Any]:
    rows = [{k: v for k, v in e.items() if k != "age_seconds"} for e in report["checkpoints"]]
    temps = [{k: v for k, v in t.items() if k != "age_seconds"} for t in report["temporary_files"]]
    return report | {"checkpoints": rows, "temporary_files": temps}


def test_the_fast_path_gives_the_torch_paths_report_on_every_folder_and_answers_only_for_sound_ones(tmp_path):
    corpus = _corpus(tmp_path)
    for name, folder in corpus.items():
        for verify in (False, True):
            fast, slow = list_folder(folder, verify=verify), list_folder(folder, verify=verify, fast=False)
            assert _without_ages(fast) == _without_ages(slow), (name, verify)
            try:
                _fast.fast_entries(folder, verify, 0.0)
                answered = True
            except PeekUnsure:
                answered = False
            # a damaged older checkpoint is found by --verify only (resume checks CRCs newest first), on both paths
            assert answered == (name in FAST or (name == "flipped oldest" and not verify)), (name, verify)
    damaged = list_folder(corpus["flipped newest"])["checkpoints"][-1]
    assert damaged["status"] == "damaged" and "CRC" in damaged["reason"]  # the torch path's words
    sharded = list_folder(corpus["sharded"])["checkpoints"]
    assert [(e["name"], e["epoch"], e["status"]) for e in sharded] == [
        (checkpoint_name(10), 1, "valid"),
        (sharded_checkpoint_name(20), 2, "valid"),
    ]


def test_list_verify_and_import_dist_resume_never_import_torch_for_sound_checkpoints(tmp_path):
    folder = _sharded(_sound(tmp_path / "ckpts"), 30)
    a, b = folder / checkpoint_name(10), tmp_path / "copy.pt"
    b.write_bytes(a.read_bytes())
    code = (
        "import sys, dist_resume\n"
        "assert 'torch' not in sys.modules, 'import dist_resume imported torch'\n"
        "assert set(dist_resume.__all__) | {'errors', 'tools'} <= set(dir(dist_resume)), dir(dist_resume)\n"
        "assert 'torch' not in sys.modules, 'dir(dist_resume) imported torch'\n"
        "from dist_resume.cli import main\n"
        f"for argv in (['list', {str(folder)!r}], ['list', '--verify', {str(folder)!r}], "
        f"['list', '--json', {str(folder)!r}], ['verify', {str(a)!r}, {str(b)!r}]):\n"
        "    assert main(argv) == 0\n"
        "    assert 'torch' not in sys.modules, argv\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "resume would pick: ckpt_00000030.dcp" in done.stdout and "equal: " in done.stdout
    # a damaged folder takes the torch path (and says what is wrong in its words)
    _flip_tensor_byte(folder / checkpoint_name(20))
    probe = f"import sys\nfrom dist_resume.cli import main\nmain(['list', '--verify', {str(folder)!r}])\nprint('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("True") and "DAMAGED" in done.stdout


def test_the_fast_paths_names_are_the_toolkits():
    assert _fast.CHECKPOINT_NAME.pattern == CHECKPOINT_NAME.pattern
    assert _fast.FORMAT_NAME == FORMAT_NAME
    assert (_fast.FORMAT_KEY, _fast.META_KEY) == (Key.FORMAT, Key.META)
    assert _fast.FORMAT_VERSION == (Key.VERSION, FORMAT_VERSION)
    assert _fast_verify._GROUP_BOOKKEEPING == GROUP_BOOKKEEPING
    assert _fast_verify._KEYED_PARTS == (Key.MODEL, Key.OPTIMIZER, Key.SCHEDULER, Key.SCALER, Key.EMA)
    keys = ["w", "fc.weight", "module.fc.w", "module", "a.module.b", "_orig_mod.w", "a._orig_mod.b", "_orig_mod"]
    for key in keys + ["module.module.x", "submodule.weight", "a.b.c"]:
        assert _fast_verify._plain_key(key) == (canonical_key(key) == key and prefix_style([key]) == "none"), key
    part_keys = {"model": "model", "x": "y"}
    side = {"path": "a.pt", "layout": "dist_resume", "prefix_style": "none", "part_keys": part_keys}
    report = {"compared": {"model_tensors": 1, "optimizer_tensors": 0}, "equal": True, "a": side, "b": side}
    assert render_verify(report).splitlines()[1] == f"  A: dist_resume, prefix none; {describe_keys(part_keys)}"


def _trained(seed: int = 0, named: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    params = model.named_parameters() if named else model.parameters()
    opt = torch.optim.AdamW(params, lr=1e-2)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    return model, opt


def _pairs(root: Path) -> dict[str, tuple[Path, Path]]:
    """Pairs of checkpoints ``verify`` meets, by name; the ones in FAST_PAIRS are answered without torch."""
    root.mkdir(exist_ok=True)

    def save(name: str, **kw: Any) -> Path:
        return Path(dr.save_checkpoint(root / name, **kw))

    model, opt = _trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    full = {"model": model, "optimizer": opt, "scheduler": sched, "step": 3, "epoch": 1}
    a, b = save("a.pt", **full), save("b.pt", **full)
    named_model, named_opt = _trained(named=True)
    pairs = {"equal": (a, b), "one has more parts": (a, save("model_only.pt", model=model, step=3))}
    pairs["named params"] = (
        save("n1.pt", model=named_model, optimizer=named_opt),
        save("n2.pt", model=named_model, optimizer=named_opt),
    )
    pairs["other weights"] = (a, save("other.pt", **(full | {"model": _trained(seed=1)[0]})))
    pairs["other step"] = (a, save("step4.pt", **(full | {"step": 4})))
    raw = torch.load(a, weights_only=True)

    def variant(name: str, change: Any) -> Path:
        obj = torch.load(a, weights_only=True)
        change(obj)
        torch.save(obj, root / name)
        return root / name

    pairs["ddp keys"] = (
        a,
        variant("ddp.pt", lambda o: o.update(model=OrderedDict((f"module.{k}", v) for k, v in o["model"].items()))),
    )
    pairs["strided view"] = (
        a,
        variant("view.pt", lambda o: o["model"].update({"0.weight": o["model"]["0.weight"].t().contiguous().t()})),
    )
    nan = variant("nan1.pt", lambda o: o["model"]["0.bias"].fill_(float("nan")))
    pairs["nan equal bits"] = (nan, variant("nan2.pt", lambda o: o["model"]["0.bias"].fill_(float("nan"))))
    zero = variant("zero.pt", lambda o: o["model"]["0.bias"].fill_(0.0))
    pairs["minus zero"] = (zero, variant("mzero.pt", lambda o: o["model"]["0.bias"].fill_(-0.0)))
    pairs["betas as a list"] = (  # equal to the torch path (a list is a tuple there); the fast path is unsure
        a,
        variant(
            "betas.pt",
            lambda o: o["optimizer"]["param_groups"][0].update(betas=list(o["optimizer"]["param_groups"][0]["betas"])),
        ),
    )
    pairs["float epoch"] = (a, variant("fepoch.pt", lambda o: o["meta"].update(epoch=1.0)))
    flipped = root / "flipped.pt"
    flipped.write_bytes(b.read_bytes())
    _flip_tensor_byte(flipped)
    pairs["flipped tensor byte"] = (a, flipped)
    truncated = root / "truncated.pt"
    truncated.write_bytes(b.read_bytes()[:2000])
    pairs["truncated"] = (a, truncated)
    torch.save(raw["model"], root / "bare.pt")
    pairs["bare state dict"] = (a, root / "bare.pt")
    pairs["sharded folder"] = (a, Path(dr.tools.convert_checkpoint(a, root / "a.dcp", format="sharded").dst))
    pairs["missing"] = (a, root / "nothing.pt")
    return pairs


FAST_PAIRS = {"equal", "one has more parts", "named params", "nan equal bits"}


def _outcome(a: Path, b: Path, fast: bool) -> Any:
    try:
        return verify_checkpoints(a, b, fast=fast)
    except DistResumeError as err:
        return type(err), str(err)


def test_verifys_fast_path_gives_the_torch_paths_report_on_every_pair_and_answers_only_equal_files(tmp_path):
    for name, (a, b) in _pairs(tmp_path).items():
        for x, y in ((a, b), (b, a)):
            assert _outcome(x, y, True) == _outcome(x, y, False), name
            try:
                _fast_verify.fast_verify(x, y)
                answered = True
            except PeekUnsure:
                answered = False
            assert answered == (name in FAST_PAIRS), name


def test_peek_reads_what_torch_save_writes_and_is_unsure_of_anything_else(tmp_path):
    path = tmp_path / "a.pt"
    view = torch.arange(12.0).reshape(3, 4)[1:, ::2]
    torch.save({"w": torch.ones(2, 3, dtype=torch.bfloat16), "v": view, "n": 3, "od": OrderedDict(a=1)}, path)
    obj = peek_archive(path).obj
    w, v = obj["w"], obj["v"]
    assert isinstance(w, TensorStub) and (w.shape, w.storage.dtype, w.is_contiguous) == ((2, 3), "bfloat16", True)
    assert (v.shape, v.stride, v.offset, v.is_contiguous, v.storage.numel) == ((2, 2), (4, 2), 4, False, 12)
    assert obj["n"] == 3 and obj["od"] == OrderedDict(a=1)
    unsure = {
        "namespace": {"args": argparse.Namespace(lr=1)},
        "parameter": {"p": nn.Parameter(torch.ones(1))},
        "sparse": {"s": torch.eye(2).to_sparse()},
        "bytes": {"b": b"raw"},
        "set": {"s": {1, 2}},
        "float8": {"f": torch.ones(2, dtype=torch.float8_e4m3fn)},
    }
    for name, obj in unsure.items():
        torch.save(obj, tmp_path / f"{name}.pt")
        with pytest.raises(PeekUnsure):
            peek_archive(tmp_path / f"{name}.pt")
    nested: list[Any] = []
    for _ in range(40):
        nested = [nested]
    torch.save({"deep": nested}, tmp_path / "deep.pt")
    with pytest.raises(PeekUnsure, match="nested"):
        peek_archive(tmp_path / "deep.pt")


def test_peek_refuses_a_pickle_that_would_run_code_before_running_anything(tmp_path):
    marker = tmp_path / "ran"

    class Boom:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "evil.pt"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"x": Boom()}, protocol=2))
        zf.writestr("archive/version", "3\n")
    with pytest.raises(PeekUnsure):
        peek_archive(path)
    assert not marker.exists()


def _op_str(text: str) -> bytes:
    data = text.encode()
    return b"X" + len(data).to_bytes(4, "little") + data


_ORDERED_DICT = b"ccollections\nOrderedDict\n)R"
_TENSOR = (
    b"ctorch._utils\n_rebuild_tensor_v2\n("
    + b"(" + _op_str("storage") + b"ctorch\nFloatStorage\n" + _op_str("0") + _op_str("cpu") + b"K\x01tQ"
    + b"K\x00K\x01\x85K\x01\x85\x89" + _ORDERED_DICT + b"tR"
)  # fmt: skip


def _archive(path: Path, body: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("archive/data.pkl", b"\x80\x02" + body + b".")
        zf.writestr("archive/data/0", b"\x00" * 4)
        zf.writestr("archive/version", "3\n")
    return path


def test_peek_lets_no_opcode_change_a_stub_or_shadow_a_dicts_methods(tmp_path):
    assert peek_archive(_archive(tmp_path / "ok.pt", _TENSOR)).obj == TensorStub(
        peek_archive(tmp_path / "ok.pt").obj.storage, 0, (1,), (1,), False
    )
    metadata = _ORDERED_DICT + b"N}" + _op_str("_metadata") + b"}s\x86b"  # what torch.save writes for a state dict
    assert peek_archive(_archive(tmp_path / "meta.pt", metadata)).obj._metadata == {}
    refused = {
        "state set on a tensor": _TENSOR + b"N}" + _op_str("shape") + _op_str("x") + b"s\x86b",
        "state set on a storage type": b"ctorch\nFloatStorage\n}b",
        "a method shadowed": _ORDERED_DICT + b"N}" + _op_str("keys") + b"K\x05s\x86b",
        "a storage on its own": b"(" + _op_str("storage") + b"ctorch\nFloatStorage\n" + _op_str("0") + _op_str("cpu") + b"K\x01tQ",
        "a function as a value": b"ctorch._utils\n_rebuild_tensor_v2\n",
        "a tensor as a key": b"}" + _TENSOR + b"K\x01s",
    }  # fmt: skip
    for name, body in refused.items():
        try:
            peek_archive(_archive(tmp_path / "x.pt", body))
        except PeekUnsure:
            continue
        pytest.fail(f"peek read a pickle with {name}")
