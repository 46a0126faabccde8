"""The bad-input corpus: every broken or mismatched checkpoint raises a specific DistResumeError.

For each case: the exact error class, a message naming the file and the fix, the model and the
optimizer bitwise untouched, and nothing executed (a pickle that would call ``os.system`` leaves
no marker file).
"""

from __future__ import annotations

import copy
import io
import json
import os
import pickle
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.records import read_records
from dist_resume._source.listing import checkpoint_name


class Net(nn.Module):
    """Two same-shaped layers and a head; ``swapped=True`` registers fc2 before fc1 (same names, same shapes)."""

    def __init__(self, swapped: bool = False) -> None:
        super().__init__()
        if swapped:
            self.fc2 = nn.Linear(4, 4)
            self.fc1 = nn.Linear(4, 4)
        else:
            self.fc1 = nn.Linear(4, 4)
            self.fc2 = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.fc2(self.fc1(x).relu()))
        return out


class OtherNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(4, 4, 3)
        self.out = nn.Linear(4, 2)


def _trained(
    seed: int, swapped: bool = False, opt_cls: type[torch.optim.Optimizer] = torch.optim.SGD, **opt_kwargs: Any
) -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(swapped)
    kwargs = opt_kwargs or ({"lr": 0.1, "momentum": 0.9} if opt_cls is torch.optim.SGD else {"lr": 0.01})
    opt = opt_cls(model.parameters(), **kwargs)
    for _ in range(2):
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _bytes(obj: Any) -> Any:
    """Every tensor in ``obj`` as raw bytes, so NaN and -0.0 compare exactly."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().reshape(-1).contiguous().view(torch.uint8).clone()
    if isinstance(obj, dict):
        return {k: _bytes(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bytes(v) for v in obj]
    return copy.deepcopy(obj)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


MARKER = "dist_resume_corpus_marker"


class _RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture
def good(tmp_path: Path) -> Path:
    """A valid toolkit checkpoint of ``Net`` + SGD(momentum) at step 7."""
    model, opt = _trained(seed=1)
    path = tmp_path / "good.pt"
    dr.save_checkpoint(path, model=model, optimizer=opt, step=7)
    return path


@pytest.fixture(autouse=True)
def nothing_executed(tmp_path: Path) -> Iterator[None]:
    yield
    assert not (tmp_path / MARKER).exists(), "a pickle ran code while loading"


def _write(tmp_path: Path, name: str, data: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(data)
    return path


def _zip_without_pickle(good: Path, tmp_path: Path) -> Path:
    import zipfile

    path = tmp_path / "no_pickle.pt"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            if not info.filename.endswith("/data.pkl"):
                dst.writestr(info, src.read(info.filename))
    return path


def _flipped(good: Path, tmp_path: Path) -> Path:
    _, records = read_records(good)
    record = next(r for r in records if "/data/" in r.name and r.file_size >= 16)
    data = bytearray(good.read_bytes())
    data[record.data_offset + 5] ^= 0x10
    return _write(tmp_path, "flipped.pt", bytes(data))


def _legacy(good: Path, tmp_path: Path) -> Path:
    buf = io.BytesIO()
    torch.save(torch.load(good, weights_only=True), buf, _use_new_zipfile_serialization=False)
    return _write(tmp_path, "legacy.pt", buf.getvalue())


def _torch_zip_that_runs_code(good: Path, tmp_path: Path) -> Path:
    path = tmp_path / "runs_code.pt"
    torch.save({"model": Net().state_dict(), "hook": _RunsCode(tmp_path / MARKER)}, path)
    return path


def _truncated(fraction: float) -> Callable[[Path, Path], Path]:
    def make(good: Path, tmp_path: Path) -> Path:
        data = good.read_bytes()
        cut = max(1, min(len(data) - 1, int(len(data) * fraction)))
        return _write(tmp_path, f"truncated_{fraction}.pt", data[:cut])

    return make


def _random_bytes(good: Path, tmp_path: Path) -> Path:
    data = bytes(random.Random(5).getrandbits(8) for _ in range(4096))
    assert not data.startswith((b"PK", b"\x80"))
    return _write(tmp_path, "random.pt", data)


# (case, file factory, resume keywords, expected class, words that must be in the message: the fix)
FILE_CASES: list[tuple[str, Callable[[Path, Path], Path], dict[str, Any], type[Exception], tuple[str, ...]]] = [
    (
        "empty",
        lambda g, t: _write(t, "empty.pt", b""),
        {},
        dr.errors.CheckpointCorruptError,
        ("empty", "earlier checkpoint"),
    ),
    ("truncated 0.1%", _truncated(0.001), {}, dr.errors.CheckpointCorruptError, ("truncated", "earlier checkpoint")),
    ("truncated 50%", _truncated(0.5), {}, dr.errors.CheckpointCorruptError, ("truncated", "earlier checkpoint")),
    (
        "truncated -1 byte",
        _truncated(0.9999),
        {},
        dr.errors.CheckpointCorruptError,
        ("truncated", "earlier checkpoint"),
    ),
    ("random bytes", _random_bytes, {}, dr.errors.NotACheckpointError, ("not a file written by torch.save", ".pt")),
    (
        "flipped byte, verify",
        _flipped,
        {"verify": True},
        dr.errors.CheckpointCorruptError,
        ("CRC32", "earlier checkpoint"),
    ),
    (
        "zip without data.pkl",
        _zip_without_pickle,
        {},
        dr.errors.NotACheckpointError,
        ("data.pkl", "saved with torch.save"),
    ),
    ("legacy format", _legacy, {}, dr.errors.NotACheckpointError, ("legacy", "re-save it")),
    (
        "legacy format, mmap=False, verify",
        _legacy,
        {"mmap": False, "verify": True},
        dr.errors.NotACheckpointError,
        ("legacy", "re-save it"),
    ),
    (
        "plain pickle calling os.system",
        lambda g, t: _write(t, "runs_code.pkl", pickle.dumps(_RunsCode(t / MARKER))),
        {},
        dr.errors.NotACheckpointError,
        ("plain pickle",),
    ),
    (
        "torch file calling os.system",
        _torch_zip_that_runs_code,
        {},
        dr.errors.UnsafeCheckpointError,
        ("system", "would run code", "do not load it"),
    ),
    (
        "torch file calling os.system, verify",
        _torch_zip_that_runs_code,
        {"verify": True},
        dr.errors.UnsafeCheckpointError,
        ("system", "would run code"),
    ),
    (
        "JSON",
        lambda g, t: _write(t, "ckpt.json", json.dumps({"model": {"w": [1.0]}}).encode()),
        {},
        dr.errors.NotACheckpointError,
        ("torch.save",),
    ),
]


@pytest.mark.parametrize("case,make,kwargs,expected,fix", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_bad_file(
    good: Path,
    tmp_path: Path,
    case: str,
    make: Callable[[Path, Path], Path],
    kwargs: dict[str, Any],
    expected: type[Exception],
    fix: tuple[str, ...],
) -> None:
    path = make(good, tmp_path)
    model, opt = _trained(seed=2)
    before = (_bytes(model.state_dict()), _bytes(opt.state_dict()))
    with pytest.raises(dr.DistResumeError) as info:
        dr.resume(path, model=model, optimizer=opt, options=dr.ResumeOptions(**kwargs))
    assert type(info.value) is expected, f"{case}: {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert str(path) in msg, msg
    for word in fix:
        assert word in msg, f"{case}: {word!r} not in {msg!r}"
    assert _same(before, (_bytes(model.state_dict()), _bytes(opt.state_dict())))


def test_flipped_byte_loads_silently_without_verify(good: Path, tmp_path: Path) -> None:
    """Why ``verify=True`` exists: torch.load never checks the CRC (and the flip is in a tensor)."""
    path = _flipped(good, tmp_path)
    model, opt = _trained(seed=2)
    dr.resume(path, model=model, optimizer=opt, options=dr.ResumeOptions(rng=False))
    reference, _ = _trained(seed=2)
    dr.resume(good, model=reference, options=dr.ResumeOptions(rng=False))
    assert not _same(_bytes(model.state_dict()), _bytes(reference.state_dict()))


@pytest.mark.parametrize("contents", ["empty", "broken"])
def test_bad_folder(tmp_path: Path, contents: str) -> None:
    folder = tmp_path / "ckpts"
    folder.mkdir()
    if contents == "broken":
        (folder / checkpoint_name(1)).write_bytes(b"")
        (folder / checkpoint_name(2)).write_bytes(b"PK\x03\x04" + bytes(100))
        torch.save({"hook": _RunsCode(tmp_path / MARKER)}, folder / checkpoint_name(3))
    model, opt = _trained(seed=2)
    before = (_bytes(model.state_dict()), _bytes(opt.state_dict()))
    expected = dr.errors.CheckpointNotFoundError if contents == "empty" else dr.errors.CheckpointCorruptError
    with pytest.raises(dr.DistResumeError) as info:
        dr.resume(folder, model=model, optimizer=opt)
    assert type(info.value) is expected
    msg = str(info.value)
    assert str(folder) in msg
    assert ("start from scratch" if contents == "empty" else "restore a good checkpoint") in msg
    if contents == "broken":
        assert all(checkpoint_name(s) in msg for s in (1, 2, 3)) and "UnsafeCheckpointError" in msg
    assert _same(before, (_bytes(model.state_dict()), _bytes(opt.state_dict())))


def _other_arch(good: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = OtherNet()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _other_optimizer(good: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    return _trained(seed=2, opt_cls=torch.optim.Adam)


def _group_sizes(good: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, _ = _trained(seed=2)
    groups: list[dict[str, Any]] = [
        {"params": [*model.fc1.parameters(), *model.fc2.parameters()]},
        {"params": list(model.head.parameters()), "lr": 0.01},
    ]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    return model, opt


def _fewer_params(good: Path) -> tuple[nn.Module, torch.optim.Optimizer]:
    model, _ = _trained(seed=2)
    params = [p for name, p in model.named_parameters() if not name.startswith("head")]
    return model, torch.optim.SGD(params, lr=0.1, momentum=0.9)


MISMATCH_CASES = [
    ("another architecture", _other_arch, dr.errors.KeyMismatchError, ("conv.weight", "fc1.weight")),
    ("another optimizer class", _other_optimizer, dr.errors.OptimizerStateMismatchError, ("SGD", "Adam")),
    ("param group size mismatch", _fewer_params, dr.errors.OptimizerStateMismatchError, ("group sizes", "[6]", "[4]")),
]


@pytest.mark.parametrize("case,build,expected,words", MISMATCH_CASES, ids=[c[0] for c in MISMATCH_CASES])
def test_mismatched_objects(
    good: Path,
    case: str,
    build: Callable[[Path], tuple[nn.Module, torch.optim.Optimizer]],
    expected: type[Exception],
    words: tuple[str, ...],
) -> None:
    model, opt = build(good)
    before = (_bytes(model.state_dict()), _bytes(opt.state_dict()))
    with pytest.raises(dr.DistResumeError) as info:
        dr.resume(good, model=model, optimizer=opt)
    assert type(info.value) is expected, f"{case}: {type(info.value).__name__}: {info.value}"
    msg = str(info.value)
    assert str(good) in msg
    for word in words:
        assert word in msg, f"{case}: {word!r} not in {msg!r}"
    assert _same(before, (_bytes(model.state_dict()), _bytes(opt.state_dict())))


def test_param_groups_split_differently_are_regrouped_by_name(good: Path) -> None:
    model, opt = _group_sizes(good)
    assert "optimizer" in dr.resume(good, model=model, optimizer=opt).restored
    saved = torch.load(good, weights_only=True)["optimizer"]
    (group,) = saved["param_groups"]
    by_name = dict(zip(group["param_names"], group["params"]))
    for name, p in model.named_parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], saved["state"][by_name[name]]["momentum_buffer"]), name
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.01]  # the live groups' hyper-parameters are kept


def test_same_shaped_parameters_swapped_in_module_order_are_rematched_by_name(good: Path) -> None:
    """fc1/fc2 registered in the other order: positions 0-3 swap, shapes stay equal (FACTS #1).

    Plain ``Optimizer.load_state_dict`` would pair fc1's momentum with fc2's weight silently; the
    toolkit file stores canonical ``param_names``, so resume() re-matches by name. Asserted: re-matched.
    """
    saved_model, saved_opt = _trained(seed=1)
    saved_state = {name: saved_opt.state[p]["momentum_buffer"] for name, p in saved_model.named_parameters()}
    model, opt = _trained(seed=3, swapped=True)
    assert [n for n, _ in model.named_parameters()][:2] == ["fc2.weight", "fc2.bias"]
    dr.resume(good, model=model, optimizer=opt, options=dr.ResumeOptions(rng=False))
    for name, p in model.named_parameters():
        assert torch.equal(p, saved_model.get_parameter(name)), name
        assert torch.equal(opt.state[p]["momentum_buffer"], saved_state[name]), name
    plain = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain.load_state_dict(saved_opt.state_dict())  # what torch alone does: pairs by position
    assert not torch.equal(plain.state[model.fc1.weight]["momentum_buffer"], saved_state["fc1.weight"])
