"""Property tests: a valid checkpoint with one value replaced, removed or added anywhere (a huge int, NaN, a tensor
where a number is expected, a list where a dict is, an int key among str keys, a number past its range, a tensor of
another kind: sparse, nested, quantized, meta, expanded, ...) and saved again by ``torch.save``, or a sharded folder
whose ``manifest.json`` holds any JSON value at any place, reaches every public reader: the only way out is success or
a :class:`DistResumeError` (validation is total, its messages included), a failed resume leaves the live objects
bitwise unchanged, a manager whose newest checkpoint is damaged falls back to the older one, and every reader of the
folder gives the one verdict on the newest checkpoint (``check_numbered``): ``latest_checkpoint`` and ``dist-resume
list`` (with and without ``--verify``) name it exactly when that takes it, and the manager falls back exactly when it
does not.

The default run is seeded and bounded (``derandomize=True``); the ``slow`` variants run many more examples.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
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
from dist_resume._source.listing import CHECKPOINT_NAME, check_numbered
from dist_resume.cli import main
from dist_resume.cli._common import ExitCode
from dist_resume.errors import CheckpointCorruptError, DistResumeError
from tests.models import assert_same, snapshot

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from _fuzz_structural import ODD_VALUES, TENSOR_KINDS, edited, odd_kind, places  # the fuzzers' own generators

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
        out[kind] = Base(kind, older, obj, places(obj))
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
        # numbers past their range where a count, a size or a time is, and tensors of other kinds (issue 45)
        *((lambda v=v: v) for v in ODD_VALUES if type(v) is int and not 0 <= v < 2**63),
        *((lambda k=k: odd_kind(None, k)) for k in TENSOR_KINDS),
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


def _manager_resumes_or_falls_back(kind: str, folder: Path, by_path: Any, taken: bool, escapes: list[str]) -> None:
    live = _live(kind, 2)
    before = live.state()
    with dr.CheckpointManager(folder, **live.objects()) as mgr:
        got = _typed("CheckpointManager.resume", mgr.resume, escapes)
    if isinstance(got, Exception):
        assert_same(live.state(), before)
        # a newest checkpoint that is damaged is never the end of a folder's resume: the older one is there
        assert taken and not isinstance(by_path, CheckpointCorruptError), (by_path, got)
    elif not taken:  # the verdict refused the newest: the older one, as latest() and list say
        assert got.step == 5, got
    elif got.step == 5:  # taken, then found damaged as it was read: resume() by path says so too
        assert isinstance(by_path, CheckpointCorruptError), (by_path, got)


def _read_every_way(kind: str, path: Path, folder: Path, escapes: list[str]) -> None:
    """``path`` through every public reader, by path and as the newest checkpoint of ``folder``; every reader of the
    folder gives the one verdict on it (``check_numbered``, what the manager's choice runs)."""
    _typed("load_checkpoint", lambda: dr.load_checkpoint(path), escapes)
    _typed("inspect_checkpoint", lambda: dr.tools.inspect_checkpoint(path), escapes)
    _typed("verify_archive", lambda: dr.tools.verify_archive(path), escapes)
    step = int(CHECKPOINT_NAME.match(path.name).group(1))  # type: ignore[union-attr]
    taken = not isinstance(_typed("the verdict", lambda: check_numbered(path, step, verify=True), escapes), Exception)
    by_path = _resume_refuses_cleanly(kind, path, escapes)
    latest = _typed("latest_checkpoint", lambda: dr.tools.latest_checkpoint(folder), escapes)
    newest = path.name if taken else "ckpt_00000005.pt"
    assert isinstance(latest, Exception) or getattr(latest, "name", None) == newest, (latest, taken)
    _manager_resumes_or_falls_back(kind, folder, by_path, taken, escapes)
    for args in (["list", folder, "--json"], ["list", folder, "--verify", "--json"], ["inspect", path]):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            code = _typed(f"dist-resume {args[0]}", functools.partial(main, [str(a) for a in args]), escapes)
        if code == ExitCode.INTERNAL:
            escapes.append(f"dist-resume {' '.join(map(str, args))}: internal error")
        elif args[0] == "list" and code == ExitCode.OK:  # the report "resume would pick" names the same one
            pick = json.loads(out.getvalue())["pick"]
            assert pick == newest, (args, pick, taken)


def _folder_with(root: Path, older: Path) -> Path:
    folder = root / "ckpts"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copy(older, folder / "ckpt_00000005.pt")
    return folder


# ------------------------------------------------------------------------------------------------- the properties

edits = st.one_of(
    st.tuples(st.sampled_from(["set", "set", "set", "drop", "add"]), values, keys),
    st.tuples(st.just("kind"), st.sampled_from(TENSOR_KINDS), st.none()),  # the value in place, of another kind
)


_MEANT = {("meta",), ("rng",), ("scheduler",), ("scaler",), ("sampler",), ("format_version",)}


def _check_file_edit(bases: dict[str, Base], tmp: Path, data: st.DataObject) -> None:
    base = bases[data.draw(st.sampled_from(sorted(bases)), label="optimizer")]
    obj: Any = base.obj
    for _ in range(data.draw(st.integers(1, 3), label="edits")):  # later edits may land on an earlier one's value
        every = places(obj) if obj is not base.obj else base.paths
        # the places whose meaning a reader checks (meta, the small states, the optimizer's groups and counters),
        # drawn as often as all places together: among hundreds of tensors they would seldom come up
        meant = [p for p in every if p[:1] in _MEANT or p[:2] == ("optimizer", "param_groups") or p[-1:] == ("step",)]
        path = data.draw(st.one_of(st.sampled_from(meant or every), st.sampled_from(every)), label="path")
        action, value, key = data.draw(edits, label="edit")
        obj = edited(obj, path, action, value, key)
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
        every = places(body)
        top = [p for p in every if len(p) == 1] or every  # the manifest's own fields, as often as all places together
        path = data.draw(st.one_of(st.sampled_from(top), st.sampled_from(every)), label="path")
        action, value, key = data.draw(st.tuples(st.sampled_from(["set", "set", "drop", "add"]), json_values, keys))
        body = edited(body, path, action, value, str(key))
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
