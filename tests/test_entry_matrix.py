"""Every hostile case of the project's own corpus through every entry point (issue 36): the same invariants on each.

The cases: each reproducer the mutation fuzzer kept (``tests/fuzz_cases/``, placed as ``scripts/fuzz.py --replay``
places it: a file on its own, or the member of a corpus folder it replaces) and each bad file of the bad-input corpus
(``tests/test_corpus.py``'s ``FILE_CASES``, built by its own factories). The entry points: ``load_checkpoint``,
``inspect_checkpoint``, ``verify_archive``, ``convert_checkpoint`` to every format, ``resume``, and, with the case as
the newest checkpoint of a folder beside an older valid one (a foreign folder: the folder itself),
``latest_checkpoint`` and ``CheckpointManager.resume``; then ``dist-resume list``, ``inspect``, ``verify`` and
``convert`` in this process. What each must do:

- end in success or a ``DistResumeError``, never another exception; the CLI in an exit status its page documents for
  bad input (0, 1 for verify, 2), without a traceback;
- a resume that raises leaves the live objects and the RNG streams bitwise as they were;
- a resume that succeeds put into the model what the file holds (each weight is a tensor of the file at a key ending
  in the weight's name), and a folder's resume restored the older checkpoint exactly when it did not take the case;
  ``latest_checkpoint`` names the case or the older checkpoint;
- where the corpus records the case's error (``FILE_CASES``), ``resume`` raises exactly that class.

The probe's classes (issue 45: ``PROBES``, each a sound checkpoint with one edit, re-saved by torch; two in a sharded
folder) keep the same invariants through the readers, and each gets **one verdict** from every entry point that
judges a checkpoint: whether
``inspect_checkpoint`` refuses it is whether ``latest_checkpoint`` passes over it, ``dist-resume list`` (both of its
paths, with and without ``--verify``) calls it damaged and "resume would pick" the older one, ``dist-resume inspect``
refuses it, and ``CheckpointManager.resume`` falls back to the older checkpoint (its values exactly); a checkpoint
the verdict takes but that the first ``optimizer.step()`` would reject (a hyperparameter missing, a negative
``step``) is refused by ``resume`` and by the manager alike, with the same error naming the field.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import sys
import traceback
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._source.listing import checkpoint_name, sharded_checkpoint_name
from dist_resume._store.url import location
from dist_resume.cli import main as cli_main
from dist_resume.cli._list import list_folder
from dist_resume.errors import KeyMismatchError
from tests.test_corpus import FILE_CASES, MARKER
from tests.test_corpus import _trained as corpus_trained

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from _fuzz_corpus import ADAMW_ITEMS, RESTORES, averaged, build_corpus, members, trained  # noqa: E402
from _fuzz_half_restore import CHANGED, all_or_nothing  # noqa: E402

FUZZ_CASES = REPO_ROOT / "tests" / "fuzz_cases"
MANIFEST = json.loads((FUZZ_CASES / "manifest.json").read_text())
OLDER = "ckpt_00000001.pt"  # the folder's older valid checkpoint: the corpus manager's first
# the exit statuses docs/cli.md gives for a bad input (4 is an internal error; 3 a write failure, not an input's)
CLI_BAD_INPUT = {"list": {0, 2}, "inspect": {0, 2}, "verify": {0, 1, 2}, "convert": {0, 2}}


def _fuzz_entries() -> dict[str, dict[str, Any]]:
    """One manifest entry per kept file (a file replayed on several paths is placed the same way each time)."""
    out: dict[str, dict[str, Any]] = {}
    for entry in MANIFEST:
        out.setdefault(entry["file"], entry)
    return out


FUZZ = _fuzz_entries()
BAD_INPUT = {case[0]: case for case in FILE_CASES}


# ------------------------------------------------------------------------------------------------ the probe's classes


@dataclass(frozen=True)
class Probe:
    """One of the probe's classes: a sound checkpoint of ``optimizer`` ("sgd" or "adamw") edited by ``edit``."""

    optimizer: str
    edit: Callable[[dict[str, Any]], None]
    verdict: type[Exception] | None  # what inspect_checkpoint raises (None: it takes the checkpoint)
    by_path: type[Exception]  # what resume(path) raises; where the verdict takes it, the manager raises it too
    sharded: bool = False  # the edit is of train_state.pt in a sharded checkpoint folder


def _meta(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda obj: obj["meta"].__setitem__(key, value)


def _at(*path: Any, make: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    """An edit replacing the value at ``path`` by ``make(value)``."""

    def edit(obj: dict[str, Any]) -> None:
        holder = obj
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = make(holder[path[-1]])

    return edit


def _without(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda obj: obj["optimizer"]["param_groups"][0].pop(key)


def _nested(t: Any) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.as_tensor(t, dtype=torch.float32).reshape(-1), torch.ones(2)])


def _expanded(t: Any) -> torch.Tensor:
    return torch.as_tensor(t).reshape(-1)[:1].expand(*torch.as_tensor(t).shape)


NOT_A_CKPT, OPTIM = dr.errors.NotACheckpointError, dr.errors.OptimizerStateMismatchError
PROBES: dict[str, Probe] = {
    # numbers out of their range, and an entry of another type (docs/errors.md: an int past int64 is an error)
    "meta step 10**30": Probe("sgd", _meta("step", 10**30), NOT_A_CKPT, NOT_A_CKPT),
    "meta epoch -10**30": Probe("sgd", _meta("epoch", -(10**30)), NOT_A_CKPT, NOT_A_CKPT),
    "meta epoch 2**70": Probe("sgd", _meta("epoch", 2**70), NOT_A_CKPT, NOT_A_CKPT),
    "meta world_size 2**70": Probe("sgd", _meta("world_size", 2**70), NOT_A_CKPT, NOT_A_CKPT),
    "meta saved_at 2**70": Probe("sgd", _meta("saved_at", 2**70), NOT_A_CKPT, NOT_A_CKPT),
    "meta epoch a str": Probe("sgd", _meta("epoch", "1"), NOT_A_CKPT, NOT_A_CKPT),
    # tensors of other kinds anywhere, refused by kind before an element is read
    "nested optimizer state": Probe(
        "sgd", _at("optimizer", "state", 0, "momentum_buffer", make=_nested), NOT_A_CKPT, NOT_A_CKPT
    ),
    "nested group lr": Probe("sgd", _at("optimizer", "param_groups", 0, "lr", make=_nested), NOT_A_CKPT, NOT_A_CKPT),
    "nested scheduler": Probe("sgd", _at("scheduler", "base_lrs", 0, make=_nested), NOT_A_CKPT, NOT_A_CKPT),
    "nested scaler": Probe("sgd", _at("scaler", "scale", make=_nested), NOT_A_CKPT, NOT_A_CKPT),
    "sparse rng": Probe("sgd", _at("rng", 0, "torch", make=lambda t: t.to_sparse()), NOT_A_CKPT, NOT_A_CKPT),
    "sparse model": Probe(
        "sgd", _at("model", "fc1.weight", make=lambda t: t.to_sparse()), NOT_A_CKPT, KeyMismatchError
    ),
    "expanded python rng 10**6": Probe(
        "sgd",
        _at("rng", 0, "python", make=lambda py: [py[0], torch.zeros(1, dtype=torch.int64).expand(10**6), py[2]]),
        NOT_A_CKPT,
        NOT_A_CKPT,
    ),
    "expanded optimizer state": Probe(
        "adamw", _at("optimizer", "state", 0, "exp_avg", make=_expanded), NOT_A_CKPT, NOT_A_CKPT
    ),
    "expanded model": Probe("sgd", _at("model", "fc1.weight", make=_expanded), NOT_A_CKPT, KeyMismatchError),
    # what the verdict takes but the first optimizer.step() would reject: refused at resume, the field named
    "sgd group without lr": Probe("sgd", _without("lr"), None, OPTIM),
    "sgd group without momentum": Probe("sgd", _without("momentum"), None, OPTIM),
    "adamw group without betas": Probe("adamw", _without("betas"), None, OPTIM),
    "adamw step -5": Probe(
        "adamw", _at("optimizer", "state", 0, "step", make=lambda t: torch.tensor(-5.0)), None, OPTIM
    ),
    # a sharded checkpoint falls back exactly as a file does
    "sharded meta step a tensor": Probe(
        "sgd", _meta("step", torch.tensor([7, 7])), NOT_A_CKPT, NOT_A_CKPT, sharded=True
    ),
    "sharded meta epoch 2**70": Probe("sgd", _meta("epoch", 2**70), NOT_A_CKPT, NOT_A_CKPT, sharded=True),
}
CASES = [f"fuzz:{name}" for name in sorted(FUZZ)] + [f"corpus:{name}" for name in BAD_INPUT]

ENTRIES = (
    "load_checkpoint",
    "inspect_checkpoint",
    "verify_archive",
    "convert pt",
    "convert safetensors",
    "convert dcp",
    "convert sharded",
    "resume",
    "latest_checkpoint",
    "manager resume",
    "cli list",
    "cli inspect",
    "cli verify",
    "cli convert",
)


# ------------------------------------------------------------------------------------------------ placing a case


@dataclass
class Placed:
    """One case on disk, with what the entry points need around it."""

    target: Path  # what the entry points by path read: the case file, or the folder whose member it replaced
    folder: Path  # numbered checkpoints, the case the newest; a foreign folder: itself
    original: Path  # the unmutated source (dist-resume verify compares the case with it)
    older: Path | None  # the older valid checkpoint of ``folder`` (None: a foreign folder)
    live: Callable[[], dict[str, Any]]  # fresh live objects, each state unlike the file's
    folder_live: Callable[[], dict[str, Any]]  # the same for a resume of ``folder``
    saved: Callable[[], dict[str, Any]]  # the objects ``older`` was saved from (what a fallback must restore)
    resume_options: dr.ResumeOptions
    expected: type[Exception] | None = None  # the error resume must raise, where the corpus records it


@pytest.fixture(scope="session")
def fuzz_corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_corpus(tmp_path_factory.mktemp("entry_matrix") / "corpus")


def _fuzz_live(corpus: str, every_part: bool = False) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        kind = "adamw" if corpus in ADAMW_ITEMS else "sgd"
        model, opt, sched, scaler = trained(seed=5, steps=3, optimizer=kind)
        every = {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "ema": averaged(model, 3)}
        return every if every_part else {name: every[name] for name in RESTORES[corpus]}

    return build


def _fuzz_saved() -> dict[str, Any]:
    """What the corpus's ``manager`` folder and ``sharded_run`` saved at step 1 (their older checkpoint)."""
    model, opt, sched, scaler = trained()
    return {"model": model, "optimizer": opt, "scheduler": sched, "scaler": scaler, "ema": averaged(model, 1)}


def _place_fuzz(name: str, corpus: dict[str, Path], tmp_path: Path) -> Placed:
    entry = FUZZ[name]
    item = entry["corpus"]
    source = corpus[item]
    data = (FUZZ_CASES / name).read_bytes()
    options = dr.ResumeOptions(map_location="cpu")
    if source.is_dir() and item != "manager":  # a foreign folder or a run of sharded checkpoints: the member replaced
        folder = tmp_path / "case" / source.name
        shutil.copytree(source, folder)
        member = entry.get("member") or members(source)[0]
        (folder / member).write_bytes(data)
        if item == "sharded_run":
            newest = folder / member.split("/")[0]
            older = sorted(p for p in folder.iterdir() if p.name.startswith("ckpt_"))[0]
            original = source / newest.name
            return Placed(newest, folder, original, older, _fuzz_live(item), _fuzz_live(item), _fuzz_saved, options)
        return Placed(folder, folder, source, None, _fuzz_live(item), _fuzz_live(item), _fuzz_saved, options)
    # a file: on its own, and as the newest checkpoint of a copy of the manager folder (its step-1 file kept)
    original = source / members(source)[-1] if item == "manager" else source
    target = tmp_path / f"case{original.suffix}"
    target.write_bytes(data)
    folder = tmp_path / "run"
    folder.mkdir()
    shutil.copy(corpus["manager"] / OLDER, folder / OLDER)
    # named for the step its metadata records (own.pt: 7), else listing skips it as renamed and never reads it
    (folder / checkpoint_name(7 if item == "own" else 2)).write_bytes(data)
    return Placed(
        target, folder, original, folder / OLDER, _fuzz_live(item), _fuzz_live("manager"), _fuzz_saved, options
    )


def _bad_input_saved() -> dict[str, Any]:
    model, opt = corpus_trained(seed=1)
    return {"model": model, "optimizer": opt}


def _bad_input_live() -> dict[str, Any]:
    model, opt = corpus_trained(seed=2)
    return {"model": model, "optimizer": opt}


@pytest.fixture(scope="session")
def bad_input_goods(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """test_corpus.py's ``good`` (its objects at step 7), and the same objects at step 6: the folder's older one."""
    folder = tmp_path_factory.mktemp("entry_matrix_goods")
    saved = _bad_input_saved()
    return Path(dr.save_checkpoint(folder / "good.pt", **saved, step=7)), Path(
        dr.save_checkpoint(folder / checkpoint_name(6), **saved, step=6)
    )


def _place_bad_input(name: str, goods: tuple[Path, Path], tmp_path: Path) -> Placed:
    _, make, kwargs, expected, _ = BAD_INPUT[name]
    made = tmp_path / "made"
    made.mkdir()
    good = Path(shutil.copy(goods[0], made / "good.pt"))
    target = make(good, made)
    folder = tmp_path / "run"
    folder.mkdir()
    older = Path(shutil.copy(goods[1], folder / goods[1].name))
    shutil.copy(target, folder / checkpoint_name(7))  # the case was made from a file of step 7
    options = dr.ResumeOptions(**kwargs)
    return Placed(target, folder, good, older, _bad_input_live, _bad_input_live, _bad_input_saved, options, expected)


def _probe_objects(kind: str, seed: int) -> dict[str, Any]:
    """The objects a probe checkpoint is saved from (seed 1) or resumed into (seed 2): every state differs."""
    model, opt = corpus_trained(seed, opt_cls=torch.optim.SGD if kind == "sgd" else torch.optim.AdamW)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    sched.step()
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "scaler": torch.amp.GradScaler("cpu", init_scale=seed),
    }


@pytest.fixture(scope="session")
def probe_goods(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per optimizer kind, the folder's older checkpoint (step 6) and the sound step-7 one each probe edits (with,
    beside it, the same as a sharded checkpoint folder: ``<good>.dcp``)."""
    root = tmp_path_factory.mktemp("entry_matrix_probes")
    out = {}
    for kind in ("sgd", "adamw"):
        saved = _probe_objects(kind, 1)
        older = Path(dr.save_checkpoint(root / f"{kind}-{checkpoint_name(6)}", **saved, step=6))
        good = Path(dr.save_checkpoint(root / f"{kind}-good.pt", **saved, step=7))
        if any(p.sharded and p.optimizer == kind for p in PROBES.values()):
            dr.tools.convert_checkpoint(good, good.with_suffix(".dcp"), format="sharded")
        out[kind] = (older, good)
    return out


def _sharded_with(good: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """``good``'s sharded checkpoint folder copied to ``dst``, its ``train_state.pt`` edited and the manifest made to
    agree again (each file's size and CRC-32): damage only the meaning of a value shows."""
    shutil.copytree(good.with_suffix(".dcp"), dst)
    train_state = dst / "train_state.pt"
    obj = torch.load(train_state, weights_only=True)
    edit(obj)
    torch.save(obj, train_state)
    manifest = json.loads((dst / "manifest.json").read_text())
    for entry in manifest["files"]:
        if entry["name"] == train_state.name:
            entry["size"], entry["crc32"] = train_state.stat().st_size, f"{zlib.crc32(train_state.read_bytes()):08x}"
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def _place_probe(name: str, goods: dict[str, tuple[Path, Path]], tmp_path: Path) -> Placed:
    probe = PROBES[name]
    older, good = goods[probe.optimizer]
    folder = tmp_path / "run"
    folder.mkdir()
    kept = Path(shutil.copy(older, folder / checkpoint_name(6)))
    if probe.sharded:
        target = _sharded_with(good, folder / sharded_checkpoint_name(7), probe.edit)
    else:
        obj = torch.load(good, weights_only=True)
        probe.edit(obj)
        target = folder / checkpoint_name(7)
        torch.save(obj, target)

    def live() -> dict[str, Any]:
        return _probe_objects(probe.optimizer, 2)

    def saved() -> dict[str, Any]:
        return _probe_objects(probe.optimizer, 1)

    return Placed(target, folder, good, kept, live, live, saved, dr.ResumeOptions(), probe.by_path)


# ------------------------------------------------------------------------------------------------ the invariants


def _tensors(obj: Any, path: str = "", depth: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key path, tensor) for every tensor in a loaded checkpoint (dicts, lists, tuples, objects' fields)."""
    if depth > 12:
        return
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}" if path else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}.{i}" if path else str(i), depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        yield from _tensors(vars(obj), path, depth + 1)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).contiguous().view(torch.uint8))


def _model_is_from_file(model: torch.nn.Module, path: Path) -> None:
    """Each weight of ``model`` equals a tensor of ``path`` at a key ending in the weight's name."""
    loaded = list(_tensors(dr.load_checkpoint(path, map_location="cpu")))
    for name, value in model.state_dict().items():
        found = [key for key, t in loaded if (key == name or key.endswith(f".{name}")) and _same_tensor(value, t)]
        assert found, f"{name} after the resume is none of the file's tensors named so: a silent wrong value"


def _state_equal(live: dict[str, Any], saved: dict[str, Any]) -> None:
    """The live objects hold what ``saved`` held: every state (an optimizer's per-parameter state, not its groups)."""
    from _fuzz_half_restore import _differs

    for part, obj in live.items():
        mine, theirs = obj.state_dict(), saved[part].state_dict()
        if part == "optimizer":
            mine, theirs = mine["state"], theirs["state"]
        assert not _differs(mine, theirs), f"{part} is not the older checkpoint's after falling back to it"


def _resume_guarded(objs: dict[str, Any], call: Callable[[], Any]) -> Any:
    """``call()``; a DistResumeError it raises must leave ``objs`` and the RNG streams as they were."""
    CHANGED.clear()
    result: list[Any] = []
    try:
        all_or_nothing(objs, lambda: result.append(call()))
    except dr.DistResumeError:
        assert not CHANGED, f"a refused resume left changed: {', '.join(CHANGED)}"
        raise
    return result[0]


def _cli(argv: list[str], command: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli_main(argv)
    text = err.getvalue()
    assert "Traceback (most recent call last)" not in text, text[-3000:]
    assert rc in CLI_BAD_INPUT[command], f"dist-resume {command}: exit status {rc}\n{text[-2000:]}"


def _run(entry: str, case: Placed, out: Path) -> None:
    convert = dr.tools.convert_checkpoint
    if entry == "load_checkpoint":
        dr.load_checkpoint(case.target, map_location="cpu")
    elif entry == "inspect_checkpoint":
        dr.tools.inspect_checkpoint(case.target)
    elif entry == "verify_archive":
        dr.tools.verify_archive(case.target)
    elif entry.startswith("convert "):
        fmt = entry.removeprefix("convert ")
        dst = {"pt": "out.pt", "safetensors": "out.safetensors", "dcp": "out_dcp", "sharded": "ckpt_5.dcp"}[fmt]
        convert(case.target, out / dst, format=fmt, force=True)
    elif entry == "resume":
        objs = case.live()
        if case.expected is not None:
            with pytest.raises(dr.DistResumeError) as info:
                _resume_guarded(objs, lambda: dr.resume(case.target, **objs, options=case.resume_options))
            assert type(info.value) is case.expected, f"{type(info.value).__name__}: {info.value}"
            return
        _resume_guarded(objs, lambda: dr.resume(case.target, **objs, options=case.resume_options))
        _model_is_from_file(objs["model"], case.target)
    elif entry == "latest_checkpoint":
        found = dr.tools.latest_checkpoint(case.folder)
        if case.older is not None:  # the case or the older checkpoint, nothing else
            newest = max(p.name for p in case.folder.iterdir())
            assert found is not None and Path(found).name in (case.older.name, newest), found
    elif entry == "manager resume":
        objs = case.folder_live()
        with dr.CheckpointManager(case.folder) as mgr:
            result = _resume_guarded(objs, lambda: mgr.resume(**objs))
        if case.older is None:
            assert result is None or Path(result.path).parent == case.folder, result
            return
        assert result is not None, "a folder holding a valid checkpoint started fresh"
        if Path(result.path).name == case.older.name:
            _state_equal(objs, case.saved())
        else:
            _model_is_from_file(objs["model"], Path(result.path))
    elif entry == "cli list":
        _cli(["list", str(case.folder), "--verify"], "list")
    elif entry == "cli inspect":
        _cli(["inspect", str(case.target)], "inspect")
    elif entry == "cli verify":
        _cli(["verify", str(case.original), str(case.target)], "verify")
    elif entry == "cli convert":
        _cli(["convert", str(case.target), str(out / "cli.pt"), "--to", "ddp", "--force"], "convert")
    else:  # pragma: no cover
        raise AssertionError(entry)


def _outcome(entry: str, case: str, request: pytest.FixtureRequest, work: Path) -> str:
    """What ``entry`` did with ``case`` placed in ``work``: ``""`` when it kept every invariant, else what went wrong."""
    kind, _, name = case.partition(":")
    if kind == "fuzz":  # each corpus built once per worker, and only where a case of it runs
        placed = _place_fuzz(name, request.getfixturevalue("fuzz_corpus"), work)
    else:
        placed = _place_bad_input(name, request.getfixturevalue("bad_input_goods"), work)
    out = work / "out"
    out.mkdir()
    try:
        _run(entry, placed, out)
    except dr.DistResumeError:
        pass  # typed: what a bad input may end in (the invariants of a refused resume were checked)
    except AssertionError as err:
        return f"{entry}: {err}"
    except Exception as err:  # an escape: the exception and where it was raised
        return f"{entry}: escape\n" + "".join(traceback.format_exception(err)[-3:])
    if (placed.target.parent / MARKER).exists() or (work / "made" / MARKER).exists():
        return f"{entry}: a pickle ran code"
    return ""


@pytest.mark.parametrize("case", CASES)
def test_hostile_case_through_every_entry_point(case: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """One test per case (the suite counts cases, not case x entry point); every entry point runs and each one that
    broke an invariant is named."""
    failures = []
    for i, entry in enumerate(ENTRIES):
        work = tmp_path / str(i)
        work.mkdir()
        failures.append(_outcome(entry, case, request, work))
    assert not any(failures), "\n".join(f for f in failures if f)


def _listed(folder: Path) -> list[tuple[bool, bool, str, str | None]]:
    """``(fast, verify, status of the newest row, pick)`` from ``dist-resume list``'s torch-free and torch paths."""
    out = []
    for fast in (True, False):
        for verify in (False, True):
            report = list_folder(location(folder), verify=verify, fast=fast)
            out.append((fast, verify, report["checkpoints"][-1]["status"], report["pick"]))
    return out


@pytest.mark.parametrize("case", list(PROBES))
def test_a_probe_class_gets_one_verdict_from_every_entry_point(
    case: str, probe_goods: dict[str, tuple[Path, Path]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    probe = PROBES[case]
    placed = _place_probe(case, probe_goods, tmp_path)
    for i, entry in enumerate(("load_checkpoint", "verify_archive", "cli verify")):
        (tmp_path / str(i)).mkdir()  # the matrix's invariants: success or a typed error, no traceback
        try:
            _run(entry, placed, tmp_path / str(i))
        except dr.DistResumeError:
            pass
    newest, older = placed.target.name, checkpoint_name(6)
    refused = probe.verdict is not None
    try:  # the verdict
        dr.tools.inspect_checkpoint(placed.target)
        verdict: type[Exception] | None = None
    except dr.DistResumeError as err:
        verdict = type(err)
    assert verdict is probe.verdict, verdict
    found = dr.tools.latest_checkpoint(placed.folder)
    assert found is not None and found.name == (older if refused else newest)
    status, pick = ("damaged", older) if refused else ("valid", newest)
    assert _listed(placed.folder) == [(f, v, status, pick) for f in (True, False) for v in (False, True)]
    assert cli_main(["inspect", str(placed.target)]) == (2 if refused else 0)
    capsys.readouterr()
    # a refused checkpoint: the manager falls back to the older one, its values exactly; a taken one that the first
    # optimizer.step() would reject: the manager refuses it as resume() does, the field named, nothing changed
    objs = placed.live()
    with pytest.raises(probe.by_path) as by_path:
        _resume_guarded(objs, lambda: dr.resume(placed.target, **objs))
    objs = placed.folder_live()
    with dr.CheckpointManager(placed.folder) as mgr:
        if refused:
            result = _resume_guarded(objs, lambda: mgr.resume(**objs))
            assert result is not None and result.step == 6
            _state_equal(objs, placed.saved())
        else:
            with pytest.raises(probe.by_path) as by_manager:
                _resume_guarded(objs, lambda: mgr.resume(**objs))
            assert str(by_manager.value) == str(by_path.value)
            assert any(field in str(by_path.value) for field in ("'lr'", "'momentum'", "'betas'", "'step'"))


def test_the_matrix_reaches_every_kept_reproducer_and_bad_input() -> None:
    kept = {p.name for p in FUZZ_CASES.iterdir() if p.name not in ("manifest.json", "pending.json")}
    assert kept == set(FUZZ), sorted(kept ^ set(FUZZ))
    assert len(BAD_INPUT) == len(FILE_CASES) >= 10
    assert len(ENTRIES) == 14


# ------------------------------------------------------------------------------------------------ the checks can fail


def test_the_checks_fail_on_what_they_guard_against(
    bad_input_goods: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A resume that left the model alone, a refused resume that changed it, a fallback to other values, a CLI that
    printed a traceback: each check of the matrix says so."""
    good = bad_input_goods[0]
    untouched = _bad_input_live()
    with pytest.raises(AssertionError, match="silent wrong value"):
        _model_is_from_file(untouched["model"], good)
    with pytest.raises(AssertionError, match="older checkpoint's"):
        _state_equal(untouched, _bad_input_saved())

    def half_restore() -> None:
        with torch.no_grad():
            untouched["model"].fc1.weight.add_(1)
        raise dr.errors.RestoreError("injected", part="model")

    with pytest.raises(AssertionError, match="a refused resume left changed: model"):
        _resume_guarded(untouched, half_restore)

    def raw(*args: Any, **kwargs: Any) -> None:
        raise KeyError("injected")

    monkeypatch.setattr(dr.tools, "verify_archive", raw)
    (tmp_path / "escape").mkdir()
    said = _outcome("verify_archive", "corpus:empty", request, tmp_path / "escape")
    assert said.startswith("verify_archive: escape") and "KeyError: 'injected'" in said, said
    monkeypatch.setitem(CLI_BAD_INPUT, "inspect", {0})
    with pytest.raises(AssertionError, match="exit status 2"):  # a missing file: 2, made not allowed here
        _cli(["inspect", str(tmp_path / "missing.pt")], "inspect")

    def internal_error(argv: list[str]) -> int:  # what the CLI does with a raw exception
        try:
            raise KeyError("injected")
        except KeyError:
            import traceback

            traceback.print_exc()
        return 4

    monkeypatch.setattr(sys.modules[__name__], "cli_main", internal_error)
    with pytest.raises(AssertionError, match="Traceback"):
        _cli(["inspect", str(good)], "inspect")
