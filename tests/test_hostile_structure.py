"""Property tests: a valid checkpoint with one value replaced, removed or added anywhere (a huge int, NaN, a tensor
where a number is expected, a list where a dict is, an int key among str keys, ...) and saved again by ``torch.save``,
or a sharded folder whose ``manifest.json`` holds any JSON value at any place, reaches every public reader: the only
way out is success or a :class:`DistResumeError` (validation is total, its messages included), a failed resume leaves
the live objects bitwise unchanged, and a manager whose newest checkpoint is damaged falls back to the older one.

The default run is seeded and bounded (``derandomize=True``); the ``slow`` variants run many more examples.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import shutil
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import dist_resume as dr
from dist_resume.cli import main
from dist_resume.cli._common import ExitCode
from dist_resume.errors import CheckpointCorruptError, DistResumeError
from tests.models import assert_same, snapshot

# (sign, base, power): built by ``map`` so that no strategy's repr holds an int too long for ``repr`` (10**5000)
HUGE = ((1, 10, 400), (-1, 10, 400), (1, 2, 63), (1, 2, 64), (-1, 2, 63), (1, 10, 5000), (1, 2, 1024))
DTYPES = (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.uint8, torch.bool)
SHAPES = ((), (1,), (3,), (0,), (2, 2), (4, 3), (1, 1, 1))
DATA = list(range(12))


# ------------------------------------------------------------------------------------------------- live objects


@dataclass
class Live:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    scaler: Any
    sampler: Any

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "dataloader": self.sampler,
        }

    def state(self) -> dict[str, Any]:
        out = snapshot(self.model, self.optimizer, self.scheduler, self.scaler)
        out["sampler"] = copy.deepcopy(self.sampler.state_dict())
        return out


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9),
    "RMSprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01, momentum=0.5, centered=True),
    "LBFGS": lambda m: torch.optim.LBFGS(m.parameters(), lr=0.01, history_size=2),
}


def _live(kind: str = "AdamW", seed: int = 1, *, trained: bool = False) -> Live:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    optimizer = OPTIMIZERS[kind](model)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    scaler = torch.amp.GradScaler("cpu")
    sampler = dr.ResumableDistributedSampler(DATA, num_replicas=1, rank=0)
    if trained:
        batch = torch.randn(5, 3)

        def closure() -> float:
            optimizer.zero_grad()
            loss = model(batch).pow(2).sum()
            loss.backward()
            return float(loss)

        for _ in range(2):
            optimizer.step(closure)
            scheduler.step()
        next(iter(sampler))
    return Live(model, optimizer, scheduler, scaler, sampler)


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():  # torch's own (a GradScaler on a CPU, a scheduler's order) and the library's
        warnings.simplefilter("ignore")
        yield


@dataclass(frozen=True)
class Base:
    """A valid step-5 checkpoint (the fallback) and the loaded step-10 object (what is tampered), per optimizer."""

    kind: str
    older: Path
    obj: dict[str, Any]
    paths: list[tuple[Any, ...]]


@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Base]:
    root = tmp_path_factory.mktemp("hostile_structure")
    out = {}
    for kind in OPTIMIZERS:
        live = _live(kind, 0, trained=True)
        older = root / f"{kind}-older.pt"
        with dr.CheckpointManager(root / kind, **live.objects()) as mgr:
            shutil.copy(mgr.save(5), older)
            newest = Path(mgr.save(10))
        obj = torch.load(newest, weights_only=True)
        out[kind] = Base(kind, older, obj, _paths(obj))
    return out


@pytest.fixture(scope="module")
def sharded(bases: dict[str, Base], tmp_path_factory: pytest.TempPathFactory) -> tuple[Base, Path, dict[str, Any]]:
    """The AdamW step-10 checkpoint as a sharded folder, and its manifest."""
    base = bases["AdamW"]
    root = tmp_path_factory.mktemp("hostile_manifest")
    torch.save(base.obj, root / "ckpt_00000010.pt")
    folder = Path(
        dr.tools.convert_checkpoint(root / "ckpt_00000010.pt", root / "ckpt_00000010.dcp", format="sharded").dst
    )
    return base, folder, json.loads((folder / "manifest.json").read_text())


# ------------------------------------------------------------------------------------------------- strategies


def _tensor(shape: tuple[int, ...], dtype: torch.dtype, fill: float) -> torch.Tensor:
    if dtype is torch.bool:
        return torch.full(shape, bool(fill == fill and fill), dtype=dtype)
    if not dtype.is_floating_point or dtype is torch.float16:
        fill = 3.0 if not math.isfinite(fill) else max(min(fill, 100.0), 0.0 if dtype is torch.uint8 else -100.0)
    return torch.full(shape, fill, dtype=dtype)


tensors = st.builds(
    _tensor,
    st.sampled_from(SHAPES),
    st.sampled_from(DTYPES),
    st.one_of(st.sampled_from([0.0, 1.0, -1.0, 2.5, math.nan, math.inf]), st.floats(-1e6, 1e6)),
)
leaves = st.one_of(
    st.integers(),
    st.sampled_from(HUGE).map(lambda h: h[0] * h[1] ** h[2]),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
    st.binary(max_size=6),
    tensors,
)
keys = st.one_of(st.integers(-2, 6), st.text(max_size=5), st.sampled_from(["state", "params", "lr", "step", "0"]))
# what validation trips on, drawn more often than chance would draw it: a number past int64 and float, NaN and
# infinities where an int is, tensors where a number or a flag is (0-dim, empty, several values), an int key among
# str keys, a list where a dict is, digits ``int()`` refuses
hostile = st.sampled_from(
    [
        (lambda: 10**400),
        (lambda: -(10**400)),
        (lambda: 2**64),
        (lambda: math.nan),
        (lambda: math.inf),
        (lambda: -math.inf),
        (lambda: torch.ones(3)),
        (lambda: torch.zeros(0)),
        (lambda: torch.tensor(math.nan)),
        (lambda: torch.tensor(7)),
        (lambda: torch.ones(2, dtype=torch.bool)),
        (lambda: {0: 1, "a": 2}),
        (lambda: {1: {"step": torch.tensor(1.0)}, "x": {}}),
        (lambda: [1, 2]),
        (lambda: {}),
        (lambda: None),
        (lambda: "\u00b2"),
    ]
).map(lambda make: make())
values = st.one_of(
    hostile,
    hostile,
    st.recursive(
        leaves,
        lambda kids: st.one_of(
            st.lists(kids, max_size=4),
            st.tuples(kids, kids),
            st.dictionaries(keys, kids, max_size=4),
        ),
        max_leaves=8,
    ),
)
json_leaves = st.one_of(
    st.integers(),
    st.sampled_from(HUGE[:5] + HUGE[6:]).map(lambda h: h[0] * h[1] ** h[2]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([1e308, -1e308, 5e-324]),
    st.booleans(),
    st.none(),
    st.text(max_size=6),
)
json_hostile = st.sampled_from([(1, 10, 400), (-1, 10, 400), (1, 2, 64), (-1, 1, 1)]).map(lambda h: h[0] * h[1] ** h[2])
json_values = st.one_of(
    json_hostile,  # an int past int64 and float's range where a count, a size or a time is
    st.recursive(
        json_leaves,
        lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=5), kids, max_size=4)),
        max_leaves=8,
    ),
)


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in ``obj`` (containers and leaves), but inside the long lists (an RNG state's 625 ints) the first
    three elements only."""
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, (*path, k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:3]):
            out += _paths(v, (*path, i))
    return out


def _edited(obj: Any, path: tuple[Any, ...], action: str, value: Any, key: Any) -> Any:
    """A copy of ``obj`` with the place at ``path`` replaced by ``value`` (``action`` "set"), removed ("drop"), or
    given one more entry ``key: value`` when it is a dict ("add"); a tuple on the way is rebuilt."""
    if not path:
        if action == "add" and isinstance(obj, dict):
            return {**obj, key: value}
        return value if action == "set" else obj
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        out: Any = type(obj)(obj)
        if not rest and action == "drop":
            out.pop(head, None)
        else:
            out[head] = _edited(obj[head], rest, action, value, key)
        return out
    items = list(obj)
    if not rest and action == "drop":
        del items[head]
    else:
        items[head] = _edited(obj[head], rest, action, value, key)
    return tuple(items) if isinstance(obj, tuple) else items


# ------------------------------------------------------------------------------------------------- the readers


def _typed(name: str, call: Callable[[], Any], escapes: list[str]) -> Any:
    """``call()``'s result, or the DistResumeError it raised; anything else is recorded as an escape."""
    try:
        return call()
    except DistResumeError as err:
        str(err)  # its message formats
        return err
    except Exception as err:  # what this test is for: no other exception may come out
        escapes.append(f"{name}: {type(err).__name__}: {str(err)[:300]}")
        return err


def _resume_refuses_cleanly(kind: str, path: Path, escapes: list[str]) -> Any:
    live = _live(kind, 1)
    before = live.state()
    got = _typed("resume", lambda: dr.resume(path, **live.objects()), escapes)
    if isinstance(got, Exception):
        assert_same(live.state(), before)
    return got


def _manager_resumes_or_falls_back(kind: str, folder: Path, by_path: Any, escapes: list[str]) -> None:
    live = _live(kind, 2)
    before = live.state()
    with dr.CheckpointManager(folder, **live.objects()) as mgr:
        got = _typed("CheckpointManager.resume", mgr.resume, escapes)
    if isinstance(got, Exception):
        assert_same(live.state(), before)
        # a newest checkpoint that is damaged is never the end of a folder's resume: the older one is there
        assert not isinstance(by_path, CheckpointCorruptError), (by_path, got)
    elif isinstance(by_path, CheckpointCorruptError):
        assert got.step == 5, (by_path, got)


def _read_every_way(kind: str, path: Path, folder: Path, escapes: list[str]) -> None:
    """``path`` through every public reader, by path and as the newest checkpoint of ``folder``."""
    _typed("load_checkpoint", lambda: dr.load_checkpoint(path), escapes)
    _typed("inspect_checkpoint", lambda: dr.tools.inspect_checkpoint(path), escapes)
    _typed("verify_archive", lambda: dr.tools.verify_archive(path), escapes)
    by_path = _resume_refuses_cleanly(kind, path, escapes)
    _typed("latest_checkpoint", lambda: dr.tools.latest_checkpoint(folder), escapes)
    _manager_resumes_or_falls_back(kind, folder, by_path, escapes)
    for args in (["list", folder], ["list", folder, "--verify"], ["inspect", path]):
        code = _typed(f"dist-resume {args[0]}", functools.partial(main, [str(a) for a in args]), escapes)
        if code == ExitCode.INTERNAL:
            escapes.append(f"dist-resume {' '.join(map(str, args))}: internal error")


def _folder_with(root: Path, older: Path) -> Path:
    folder = root / "ckpts"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy(older, folder / "ckpt_00000005.pt")
    return folder


# ------------------------------------------------------------------------------------------------- the properties

edits = st.tuples(st.sampled_from(["set", "set", "set", "drop", "add"]), values, keys)


def _check_file_edit(bases: dict[str, Base], tmp: Path, data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="optimizer")]
    obj: Any = base.obj
    for _ in range(data.draw(st.integers(1, 3), label="edits")):  # later edits may land on an earlier one's value
        path = data.draw(st.sampled_from(_paths(obj) if obj is not base.obj else base.paths), label="path")
        action, value, key = data.draw(edits, label="edit")
        obj = _edited(obj, path, action, value, key)
    folder = _folder_with(tmp, base.older)
    target = folder / "ckpt_00000010.pt"
    torch.save(obj, target)
    escapes: list[str] = []
    _read_every_way(base.kind, target, folder, escapes)
    assert not escapes, "\n".join(escapes)


def _check_manifest_edit(sharded: tuple[Base, Path, dict[str, Any]], tmp: Path, data: st.DataObject) -> None:
    base, original, manifest = sharded
    body: Any = manifest
    for _ in range(data.draw(st.integers(1, 2), label="edits")):
        every = _paths(body)
        top = [p for p in every if len(p) == 1] or every  # the manifest's own fields, as often as all places together
        path = data.draw(st.one_of(st.sampled_from(top), st.sampled_from(every)), label="path")
        action, value, key = data.draw(st.tuples(st.sampled_from(["set", "set", "drop", "add"]), json_values, keys))
        body = _edited(body, path, action, value, str(key))
    folder = _folder_with(tmp, base.older)
    target = folder / original.name
    shutil.copytree(original, target)
    (target / "manifest.json").write_text(_json(body))
    escapes: list[str] = []
    _read_every_way(base.kind, target, folder, escapes)
    assert not escapes, "\n".join(escapes)


def _json(body: Any) -> str:
    """``json.dumps(body)``, integers of any length included (Python refuses to print one past 4,300 digits)."""
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)
    try:
        return json.dumps(body)
    finally:
        sys.set_int_max_str_digits(limit)


_FAST = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
_LONG = settings(_FAST, max_examples=1000, derandomize=False)


@_FAST
@given(data=st.data())
def test_a_tampered_value_anywhere_in_a_checkpoint_is_success_or_a_typed_error(
    bases: dict[str, Base], tmp_path: Path, data: st.DataObject, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_file_edit(bases, tmp_path, data)
    capsys.readouterr()


@settings(_FAST, max_examples=40)
@given(data=st.data())
def test_any_json_value_anywhere_in_a_sharded_manifest_is_success_or_a_typed_error(
    sharded: tuple[Base, Path, dict[str, Any]], tmp_path: Path, data: st.DataObject, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_manifest_edit(sharded, tmp_path, data)
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.timeout(1800)
@_LONG
@given(data=st.data())
def test_long_a_tampered_value_anywhere_in_a_checkpoint(
    bases: dict[str, Base], tmp_path: Path, data: st.DataObject, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_file_edit(bases, tmp_path, data)
    capsys.readouterr()


@pytest.mark.slow
@pytest.mark.timeout(1200)
@settings(_LONG, max_examples=300)
@given(data=st.data())
def test_long_any_json_value_anywhere_in_a_sharded_manifest(
    sharded: tuple[Base, Path, dict[str, Any]], tmp_path: Path, data: st.DataObject, capsys: pytest.CaptureFixture[str]
) -> None:
    _check_manifest_edit(sharded, tmp_path, data)
    capsys.readouterr()
