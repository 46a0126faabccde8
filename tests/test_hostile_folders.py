"""Every reader over a tampered sharded checkpoint folder: a typed refusal naming the file, or the older valid
checkpoint; never a raw exception, a hang, a silent wrong answer or a byte read from outside the folder.

One real folder written by a 2-rank FSDP2 run (a CheckpointManager folder holding steps 10 and 20) is copied for each
case and its step 20 tampered with. Then, in one process:

- the folder's readers (``latest_checkpoint``, ``resolve_checkpoint``, ``CheckpointManager.resume``, ``dist-resume
  list`` on its fast, torch and ``--verify`` paths) must fall back to step 10, ``CheckpointManager.resume`` restoring
  exactly step 10's values;
- the readers of step 20 itself (``resume``, ``load_checkpoint``, ``inspect_checkpoint``, ``verify_archive``,
  ``convert_checkpoint``) must raise the case's ``DistResumeError`` naming the damaged file, and write nothing.

A case whose damage only a CRC-32 shows (a flipped data byte) is found by the readers that check CRCs (``verify``).
Each reader runs under a 20 s alarm (a FIFO opened for reading would block for ever); every file outside the folder
(another run's shard, which a link points to) keeps its bytes, and nothing is restored from it.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

import dist_resume as dr
from dist_resume._format.manifest import file_crc32
from dist_resume.cli._list import list_folder
from dist_resume.errors import CheckpointCorruptError, DistResumeError
from tests.dist import hostile_workers
from tests.dist.fsdp_workers import Net
from tests.dist.harness import run_ranks

C10, C20 = "ckpt_00000010.dcp", "ckpt_00000020.dcp"
Tamper = Callable[[Path, Path], object]  # (the checkpoint folder, a folder outside it) -> anything
SHARD = "__1_0.distcp"


class Hang(BaseException):
    """A reader outlived its alarm (a BaseException, so that no reader's own ``except Exception`` swallows it)."""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 2-rank FSDP2 folder, written once per session: xdist's workers share it (one launch, not one each)."""
    session = tmp_path_factory.getbasetemp()
    root = (session.parent if os.environ.get("PYTEST_XDIST_WORKER") else session) / "hostile_base"
    folder = root / "ckpts"
    with FileLock(f"{root}.lock"):
        if not (folder / C20 / "manifest.json").is_file():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            run_ranks(hostile_workers.save_two, 2, tmp_path=root, args=(str(folder),))
            (folder / ".dist_resume.lock").unlink()
    return folder


@pytest.fixture(scope="module")
def step10(base: Path) -> dict[str, torch.Tensor]:
    return dict(dr.load_checkpoint(base / C10, map_location="cpu")["model"])


# ---- tampering --------------------------------------------------------------------------------------------------


def _manifest(edit: Callable[[dict[str, Any]], Any]) -> Tamper:
    def tamper(folder: Path, outside: Path) -> None:
        body = json.loads((folder / "manifest.json").read_text())
        text = edit(body)
        (folder / "manifest.json").write_text(text if isinstance(text, str) else json.dumps(body))

    return tamper


def _refresh(folder: Path) -> None:
    """The manifest's sizes and CRC-32s made true again: only a structural check can find what was changed."""
    body = json.loads((folder / "manifest.json").read_text())
    for entry in body["files"]:
        path = folder / entry["name"]
        if path.is_file() and not path.is_symlink():
            entry["size"], entry["crc32"] = path.stat().st_size, f"{file_crc32(path):08x}"
    (folder / "manifest.json").write_text(json.dumps(body))


def _metadata(edit: Callable[[Any], object]) -> Tamper:
    def tamper(folder: Path, outside: Path) -> None:
        metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file: plain pickle is fine here
        edit(metadata)
        (folder / ".metadata").write_bytes(pickle.dumps(metadata))
        _refresh(folder)

    return tamper


def _train_state(edit: Callable[[dict[str, Any]], None]) -> Tamper:
    def tamper(folder: Path, outside: Path) -> None:
        state = torch.load(folder / "train_state.pt", weights_only=True)
        edit(state)
        torch.save(state, folder / "train_state.pt")
        _refresh(folder)

    return tamper


def _fifo(name: str, unlist: bool = False) -> Tamper:
    def tamper(folder: Path, outside: Path) -> None:
        if unlist:
            _manifest(lambda b: b.__setitem__("files", [f for f in b["files"] if f["name"] != name]))(folder, outside)
        (folder / name).unlink()
        os.mkfifo(folder / name)

    return tamper


def _a_folder(name: str) -> Tamper:
    def tamper(folder: Path, outside: Path) -> None:
        (folder / name).unlink()
        (folder / name).mkdir()

    return tamper


def _flip(folder: Path, name: str = SHARD, at: int | None = None) -> None:
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0xFF
    (folder / name).write_bytes(bytes(data))


def _link_out(name: str, refresh: bool) -> Tamper:
    """``name`` replaced by a link to another run's copy of it outside the folder (the manifest made to match)."""

    def tamper(folder: Path, outside: Path) -> None:
        other = outside / name
        shutil.copy(folder.parent / C10 / name, other)  # valid bytes of another save: restoring them is the defect
        (folder / name).unlink()
        (folder / name).symlink_to(other)
        if refresh:
            body = json.loads((folder / "manifest.json").read_text())
            for entry in body["files"]:
                if entry["name"] == name:
                    entry["size"], entry["crc32"] = other.stat().st_size, f"{file_crc32(other):08x}"
            (folder / "manifest.json").write_text(json.dumps(body))

    return tamper


def _relative_path_link(folder: Path, outside: Path) -> None:
    """``.metadata`` names ``link.distcp`` (listed), a link to another run's shard outside."""
    shutil.copy(folder.parent / C10 / SHARD, outside / SHARD)
    (folder / "link.distcp").symlink_to(outside / SHARD)
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        if info.relative_path == SHARD:
            info.relative_path = "link.distcp"
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    body = json.loads((folder / "manifest.json").read_text())
    body["files"].append(
        {"name": "link.distcp", "size": (outside / SHARD).stat().st_size, "crc32": "00000000", "rank": 1}
    )
    (folder / "manifest.json").write_text(json.dumps(body))
    _refresh(folder)


def _tensor(metadata: Any, multi: bool = True) -> Any:
    return next(
        md for md in metadata.state_dict_metadata.values() if hasattr(md, "chunks") and (len(md.chunks) > 1) == multi
    )


def _place(metadata: Any, path: tuple[Any, ...]) -> None:
    fqn = next(iter(metadata.planner_data))
    metadata.planner_data[fqn] = path


def _every_storage(metadata: Any, **fields: Any) -> None:
    for info in metadata.storage_data.values():
        for name, value in fields.items():
            setattr(info, name, value)


def _unsafe(metadata: Any) -> None:
    metadata.storage_meta = os.system  # a global outside DCP's classes


def _last_entry(metadata: Any, fqn: str) -> Any:
    """The storage entry of ``fqn``'s last chunk (rank 1's, in ``__1_0.distcp``)."""
    index = max((i for i in metadata.storage_data if i.fqn == fqn), key=lambda i: tuple(i.offset))
    return metadata.storage_data[index]


def _alias(metadata: Any, other: str, same_shape: bool) -> None:
    """``b.weight``'s last chunk pointed at ``other``'s bytes (its offset; with ``same_shape`` its length kept)."""
    entry, target = _last_entry(metadata, "model.b.weight"), _last_entry(metadata, other)
    entry.offset = target.offset
    if not same_shape:
        entry.length = target.length


def _lose_key(metadata: Any, fqn: str, wholly: bool) -> None:
    """``fqn`` dropped from ``state_dict_metadata``; ``wholly``: from the planner and the storage entries too."""
    del metadata.state_dict_metadata[fqn]
    if wholly:
        del metadata.planner_data[fqn]
        for index in [i for i in metadata.storage_data if i.fqn == fqn]:
            del metadata.storage_data[index]


def _shrink(metadata: Any) -> None:
    """``b.bias`` (7 elements in chunks of 4 and 3) declared 2 shorter, its last chunk too: the stored one is longer."""
    md = metadata.state_dict_metadata["model.b.bias"]
    md.size = torch.Size([md.size[0] - 2])
    md.chunks[-1].sizes = torch.Size([md.chunks[-1].sizes[0] - 2])


@dataclass(frozen=True)
class Case:
    name: str
    tamper: Tamper
    names: str  # the file the refusal names
    crc_only: bool = False  # only a CRC-32 check sees it
    payload: bool = False  # the damage is in what a file holds, its bytes as the manifest says: verify_archive passes
    error: type[DistResumeError] = CheckpointCorruptError
    deep: bool = False  # found by the checks that read the entries (verify's, or a read), not the structural one


CASES = [
    # manifest.json: bounded, typed before use
    Case(
        "saved_at_10_400",
        _manifest(lambda b: json.dumps(b).replace('"saved_at": ', '"saved_at": 1' + "0" * 400 + "+")),
        "manifest.json",
    ),
    Case(
        "nested_json",
        _manifest(lambda b: '{"format": "dist_resume.sharded", "x": ' + "[" * 50_000 + "]" * 50_000 + "}"),
        "manifest.json",
    ),
    Case("nan", _manifest(lambda b: json.dumps(b).replace('"saved_at": ', '"saved_at": NaN, "x": ')), "manifest.json"),
    Case(
        "nul_in_a_name",
        _manifest(lambda b: b["files"].append({"name": "a\x00b", "size": 1, "crc32": "00000000", "rank": 0})),
        "manifest.json",
    ),
    Case(
        "separator_in_a_name",
        _manifest(lambda b: b["files"][0].__setitem__("name", "../" + b["files"][0]["name"])),
        "manifest.json",
    ),
    # an int past float's range where a time is: its check raised OverflowError (math.isfinite), in every reader
    Case("saved_at_an_int_past_float", _manifest(lambda b: b.__setitem__("saved_at", 10**400)), "manifest.json"),
    Case("world_size_10_30", _manifest(lambda b: b.__setitem__("world_size", 10**30)), "manifest.json"),
    Case("step_a_str", _manifest(lambda b: b.__setitem__("step", "20")), "manifest.json"),
    Case("files_a_dict", _manifest(lambda b: b.__setitem__("files", {"a": 1})), "manifest.json"),
    Case("file_entry_a_list", _manifest(lambda b: b["files"].append([1, 2])), "manifest.json"),
    Case("contents_unlike_metadata", _manifest(lambda b: b.__setitem__("contents", ["model"])), ".metadata"),
    Case("manifest_fifo", _fifo("manifest.json"), "manifest.json"),
    Case("manifest_a_folder", _a_folder("manifest.json"), "manifest.json"),
    Case("manifest_a_link_out", _link_out("manifest.json", refresh=False), "manifest.json"),
    # the folder's files: every one listed, regular, inside
    Case("unlisted_dangling_link", lambda f, o: (f / "__9_0.distcp").symlink_to(f / "nowhere"), "__9_0.distcp"),
    Case("unlisted_file", lambda f, o: (f / "__5_0.distcp").write_bytes(b"x"), "__5_0.distcp"),
    Case("unlisted_fifo_train_state", _fifo("train_state.pt", unlist=True), "train_state.pt"),
    Case("shard_fifo", _fifo(SHARD), SHARD),
    Case("metadata_fifo", _fifo(".metadata"), ".metadata"),
    Case("shard_a_link_out", _link_out(SHARD, refresh=True), SHARD),
    Case("train_state_a_folder", _a_folder("train_state.pt"), "train_state.pt"),
    Case("shard_truncated", lambda f, o: os.truncate(f / SHARD, 100), SHARD),
    Case(
        "shard_dropped_from_manifest",
        _manifest(lambda b: b.__setitem__("files", [x for x in b["files"] if x["name"] != SHARD])),
        SHARD,
    ),
    # .metadata: what it promises is checked against the listed shards
    Case("chunk_dropped", _metadata(lambda m: _tensor(m).chunks.pop()), ".metadata"),
    Case("chunks_overlap", _metadata(lambda m: _tensor(m).chunks.__setitem__(1, _tensor(m).chunks[0])), ".metadata"),
    Case(
        "size_grown",
        _metadata(
            lambda m: setattr(
                _tensor(m, multi=False),
                "size",
                torch.Size([_tensor(m, multi=False).size[0] + 1, *_tensor(m, multi=False).size[1:]]),
            )
        ),
        ".metadata",
    ),
    Case("int_in_a_planner_path", _metadata(lambda m: _place(m, ("model", 0))), ".metadata"),
    Case("int_first_in_a_planner_path", _metadata(lambda m: _place(m, (0, "x"))), ".metadata"),
    Case("planner_path_inside_a_tensor", _metadata(lambda m: _place(m, ("model", "scale", "x"))), ".metadata"),
    Case(
        "relative_path_train_state",
        _metadata(lambda m: _every_storage(m, relative_path="train_state.pt")),
        ".metadata",
    ),
    Case(
        "offset_past_the_end",
        _metadata(lambda m: _every_storage(m, offset=10**6)),
        ".metadata",
    ),
    # ints a pickle holds unbounded: the refusal's own message raised ValueError (str() of 4,300+ digits)
    Case("offset_of_5000_digits", _metadata(lambda m: _every_storage(m, offset=10**5000)), ".metadata"),
    Case("relative_path_a_link_out", _relative_path_link, "link.distcp"),
    Case("global_outside_dcp", _metadata(_unsafe), ".metadata"),  # our format never holds one: damage
    # .metadata against itself and against the entries it describes (each entry read as the chunk declared for it)
    Case("storage_alias", _metadata(lambda m: _alias(m, "model.b.bias", same_shape=False)), ".metadata"),
    Case(
        "storage_alias_same_shape",
        _metadata(lambda m: _alias(m, "optimizer.state.b.weight.exp_avg", same_shape=True)),
        ".metadata",
    ),
    Case(
        "storage_transform_unknown",
        _metadata(lambda m: setattr(_last_entry(m, "model.b.weight"), "transform_descriptors", ["zstd"])),
        ".metadata",
    ),
    Case("model_entry_lost", _metadata(lambda m: _lose_key(m, "model.b.bias", wholly=False)), ".metadata"),
    Case(
        "model_entry_lost_wholly",  # .metadata consistent in itself: train_state.pt's key list still names it
        _metadata(lambda m: _lose_key(m, "model.b.bias", wholly=True)),
        ".metadata",
        payload=True,
    ),
    Case(
        "dtype_declared_int64",
        _metadata(lambda m: setattr(_tensor(m).properties, "dtype", torch.int64)),
        "__0_0.distcp",
        deep=True,
    ),
    Case(
        "dtype_declared_float64",
        _metadata(lambda m: setattr(_tensor(m).properties, "dtype", torch.float64)),
        "__0_0.distcp",
        deep=True,
    ),
    Case("size_declared_shorter", _metadata(_shrink), SHARD, deep=True),
    # train_state.pt
    Case("sharded_layout_an_int", _train_state(lambda s: s.update(sharded_layout=5)), "train_state.pt", payload=True),
    Case(
        "sharded_layout_types",
        _train_state(lambda s: s.update(sharded_layout={"order": 5, "model_keys": 3})),
        "train_state.pt",
        payload=True,
    ),
    # integrity: every byte a reader uses
    Case("flipped_data_byte", lambda f, o: _flip(f), SHARD, crc_only=True),
    Case("flipped_metadata_byte", lambda f, o: _flip(f, ".metadata", at=-3), ".metadata", crc_only=True),
]


# ---- the readers ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    value: Any = None
    error: BaseException | None = None


def _bounded(fn: Callable[[], Any]) -> Outcome:
    def alarm(*_: Any) -> None:
        raise Hang()

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, 20)
    try:
        return Outcome(fn())
    except Hang as err:
        return Outcome(error=err)
    except Exception as err:
        return Outcome(error=err)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _model() -> tuple[Net, torch.optim.Optimizer]:
    torch.manual_seed(7)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)


def _folder_readers(ckpts: Path, step10: dict[str, torch.Tensor]) -> Iterator[tuple[str, Callable[[], Any], Any]]:
    """(name, reader, what it must return): each falls back to step 10."""

    def manager_resume() -> Any:
        model, opt = _model()
        with dr.CheckpointManager(ckpts, model=model, optimizer=opt) as mgr:
            result = mgr.resume()
        assert result is not None
        same = all(torch.equal(model.state_dict()[k], v) for k, v in step10.items())
        return result.path.name, result.step, same

    def listed(**kw: Any) -> Any:
        report = list_folder(ckpts, **kw)
        return report["pick"], [(e["name"], e["status"]) for e in report["checkpoints"]]

    as_listed = (C10, [(C10, "valid"), (C20, "damaged")])
    yield "latest_checkpoint", lambda: str(dr.tools.latest_checkpoint(ckpts)), str(ckpts / C10)
    yield "resolve_checkpoint", lambda: dr.tools.resolve_checkpoint(ckpts).name, C10
    yield "CheckpointManager.resume", manager_resume, (C10, 10, True)
    yield "list", lambda: listed(), as_listed
    yield "list (torch path)", lambda: listed(fast=False), as_listed
    yield "list --verify", lambda: listed(verify=True), as_listed


def _direct_readers(c20: Path, out: Path, crc_only: bool) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, reader): each must refuse step 20 (with verify where only a CRC-32 shows the damage)."""

    def resume(verify: bool) -> Any:
        return dr.resume(c20, model=_model()[0], options=dr.ResumeOptions(verify=verify, rng=False)).step

    yield "inspect_checkpoint", lambda: dr.tools.inspect_checkpoint(c20)
    yield "verify_archive", lambda: dr.tools.verify_archive(c20)
    yield "resume(verify=True)", lambda: resume(True)
    yield "load_checkpoint(verify=True)", lambda: dr.load_checkpoint(c20, map_location="cpu", verify=True)
    yield "convert_checkpoint(check_crc=True)", lambda: dr.tools.convert_checkpoint(c20, out, check_crc=True)
    if not crc_only:  # readers that read sizes and structure, not every CRC-32 (as for a torch file)
        yield "resume", lambda: resume(False)
        yield "load_checkpoint", lambda: dr.load_checkpoint(c20, map_location="cpu")
        yield "convert_checkpoint", lambda: dr.tools.convert_checkpoint(c20, out)
        yield "latest_checkpoint(verify=False)", lambda: str(dr.tools.latest_checkpoint(c20.parent, verify=False))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_reader_refuses_or_falls_back(
    case: Case, base: Path, step10: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    ckpts, outside = tmp_path / "ckpts", tmp_path / "outside"
    shutil.copytree(base, ckpts, symlinks=True)
    outside.mkdir()
    case.tamper(ckpts / C20, outside)
    kept = _snapshot(outside)
    wrong = []
    for name, read, expected in _folder_readers(ckpts, step10):
        got = _bounded(read)
        if got.error is not None or got.value != expected:
            wrong.append(
                f"{name}: {got.error!r}" if got.error is not None else f"{name}: {got.value!r} != {expected!r}"
            )
    out = tmp_path / "out.pt"
    for name, read in _direct_readers(ckpts / C20, out, case.crc_only):
        got = _bounded(read)
        if name == "latest_checkpoint(verify=False)":  # the folder's structural check alone: step 10
            if case.deep:  # it reads no entry
                continue
            if got.error is not None or got.value != str(ckpts / C10):
                wrong.append(f"{name}: {got.error or got.value!r}")
            continue
        if name == "verify_archive" and case.payload and got.error is None:
            continue
        if not isinstance(got.error, case.error):
            wrong.append(f"{name}: {got.error!r} (returned {str(got.value)[:80]!r}), not {case.error.__name__}")
        elif case.names not in str(got.error):
            wrong.append(f"{name}: {str(got.error)[:300]!r} does not name {case.names}")
        if os.path.lexists(out):
            wrong.append(f"{name} wrote {out.name}")
            os.unlink(out)
    assert wrong == [], "\n".join(wrong)
    assert _snapshot(outside) == kept  # nothing outside the folder written


def test_a_sharded_folder_whose_manifest_and_train_state_are_fifos_is_not_read_as_a_dcp_folder(
    base: Path, tmp_path: Path
) -> None:
    """Without a regular manifest.json and train_state.pt the folder would look like torch's plain DCP folder, read
    without its manifest: their names alone make it a sharded folder, which is refused."""
    folder = tmp_path / C20
    shutil.copytree(base / C20, folder)
    for name in ("manifest.json", "train_state.pt"):
        (folder / name).unlink()
        os.mkfifo(folder / name)
    got = _bounded(lambda: dr.resume(folder, model=_model()[0], options=dr.ResumeOptions(rng=False)))
    assert isinstance(got.error, CheckpointCorruptError) and "manifest.json" in str(got.error), got


def test_a_checkpoint_found_damaged_only_when_read_is_left_for_the_previous_one(
    base: Path, step10: dict[str, torch.Tensor], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The choice of the newest checkpoint blinded to its damage (the deep check of its entries patched out): the
    read finds it (a chunk unlike its declaration) before anything changed, and the manager falls back to step 10 as
    the choice would have. A checkpoint that does not fit the model is no damage: that error stands."""
    ckpts = tmp_path / "ckpts"
    shutil.copytree(base, ckpts, symlinks=True)
    _metadata(lambda m: setattr(_tensor(m).properties, "dtype", torch.float64))(ckpts / C20, tmp_path)
    monkeypatch.setattr("dist_resume._format.sharded_files.entries_problem", lambda *_: None)
    assert dr.tools.latest_checkpoint(ckpts) == ckpts / C20  # blind: it is chosen
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp'?: the entry of 'model\.a\.weight'"):
        dr.resume(ckpts / C20, model=_model()[0], options=dr.ResumeOptions(rng=False))
    model, opt = _model()
    with dr.CheckpointManager(ckpts, model=model, optimizer=opt) as mgr:
        result = mgr.resume()
    assert result is not None and (result.path.name, result.step) == (C10, 10)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in step10.items())
    with dr.CheckpointManager(ckpts, model=torch.nn.Linear(2, 2)) as mgr, pytest.raises(dr.errors.KeyMismatchError):
        mgr.resume()
