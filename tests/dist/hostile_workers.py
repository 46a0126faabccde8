"""Per-rank bodies for the hostile-folder tests: a real 2-rank FSDP2 save to tamper with (tests/test_hostile_folders.py),
and damaged sharded folders resumed by FSDP2 ranks (tests/dist/test_hostile.py)."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch.distributed as dist

import dist_resume as dr
from dist_resume._format.manifest import file_crc32
from dist_resume.errors import DistResumeError
from tests.dist.fsdp_workers import _differ, _locals, _mesh, _sharded, _train


def save_two(rank: int, world_size: int, folder: str) -> None:
    """A CheckpointManager folder of an FSDP2 model on 2 ranks: steps 10 and 20 (sharded folders)."""
    model, opt = _sharded(_mesh(world_size), seed=0)
    with dr.CheckpointManager(Path(folder), model=model, optimizer=opt, keep_last=3) as mgr:
        for step in (10, 20):
            _train(model, opt, 1, seed=step)
            mgr.save(step)


def _tamper(rank: int, folder: Path, tamper: Callable[[Path], None]) -> None:
    """Rank 0 puts back the pristine step 20 and tampers with it; every rank waits for it."""
    if rank == 0:
        shutil.rmtree(folder / C20)
        shutil.copytree(folder / "pristine20", folder / C20)
        tamper(folder / C20)
    dist.barrier()


def _refused(path: Path, mesh: Any) -> dict[str, Any]:
    """``resume(path)`` into a trained FSDP2 model: its outcome, and what changed in the model and optimizer."""
    model, opt = _sharded(mesh, seed=5)
    _train(model, opt, 1, seed=3)
    before = _locals(model, opt)
    try:
        dr.resume(path, model=model, optimizer=opt)
        out: dict[str, Any] = {"error": None}
    except DistResumeError as err:
        out = {"error": type(err).__name__, "message": str(err), "rank": err.rank}
    except Exception as err:  # a raw error: the defect this test exists for
        out = {"error": f"raw {type(err).__name__}", "message": str(err)[:300], "rank": None}
    out["unchanged"] = _differ(_locals(model, opt), before)
    return out


def fallback_and_refusal(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """A CheckpointManager folder of an FSDP2 model (steps 10 and 20) whose step 20 is damaged in several ways: every
    rank falls back to step 10 with its exact values; and step 20 resumed by path, damaged, is refused on every rank
    before anything changes."""
    root = Path(folder)
    mesh = _mesh(world_size)
    model, opt = _sharded(mesh, seed=0)
    with dr.CheckpointManager(root, model=model, optimizer=opt, keep_last=3) as mgr:
        _train(model, opt, 1, seed=10)
        mgr.save(10)
        at10 = _locals(model, opt)
        _train(model, opt, 1, seed=20)
        mgr.save(20)
    if rank == 0:
        shutil.copytree(root / C20, root / "pristine20")
    report: dict[str, Any] = {"fallback": {}, "refused": {}}
    for name, tamper in {**FALLBACK, **FOUND_WHEN_READ}.items():
        _tamper(rank, root, tamper)
        fresh, fresh_opt = _sharded(mesh, seed=5)
        blind = mock.patch("dist_resume._format.sharded_files.entries_problem", lambda *_: None)
        try:
            with blind if name in FOUND_WHEN_READ else contextlib.nullcontext():
                with dr.CheckpointManager(root, model=fresh, optimizer=fresh_opt) as resumer:
                    result = resumer.resume()
            got: Any = (None if result is None else result.step, _differ(_locals(fresh, fresh_opt), at10))
        except Exception as err:
            got = f"{type(err).__name__}: {str(err)[:300]}"
        report["fallback"][name] = got
    for name, tamper in REFUSED.items():
        _tamper(rank, root, tamper)
        report["refused"][name] = _refused(root / C20, mesh)
    return report


def _flip(folder: Path, name: str) -> None:
    _flip_at(folder / name, (folder / name).stat().st_size // 2)


def _flip_at(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _refresh(folder: Path) -> None:
    body = json.loads((folder / "manifest.json").read_text())
    for entry in body["files"]:
        path = folder / entry["name"]
        entry["size"], entry["crc32"] = path.stat().st_size, f"{file_crc32(path):08x}"
    (folder / "manifest.json").write_text(json.dumps(body))


def _uncover(folder: Path) -> None:
    """A tensor's last chunk dropped from .metadata (the manifest made to match): the rows it held are in no chunk."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file
    next(md for md in metadata.state_dict_metadata.values() if len(getattr(md, "chunks", ())) > 1).chunks.pop()
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    _refresh(folder)


def _fifo_manifest(folder: Path) -> None:
    (folder / "manifest.json").unlink()
    os.mkfifo(folder / "manifest.json")


def _nested_manifest(folder: Path) -> None:
    (folder / "manifest.json").write_text('{"format": "dist_resume.sharded", "x": ' + "[" * 50_000 + "]" * 50_000 + "}")


def _link_out(folder: Path) -> None:
    """Rank 1's shard replaced by a link to step 10's copy of it, outside the folder (the manifest made to match)."""
    other = folder.parent / "outside.distcp"
    shutil.copy(folder.parent / C10 / "__1_0.distcp", other)
    (folder / "__1_0.distcp").unlink()
    (folder / "__1_0.distcp").symlink_to(other)


C10, C20 = "ckpt_00000010.dcp", "ckpt_00000020.dcp"
FALLBACK: dict[str, Callable[[Path], None]] = {
    "flipped_byte": lambda f: _flip(f, "__1_0.distcp"),  # found by rank 0's CRC check when it chooses
    "uncovered_rows": _uncover,
    "fifo_manifest": _fifo_manifest,
    "nested_manifest": _nested_manifest,
    "shard_linked_out": _link_out,
}


def _damage_object_entry(folder: Path) -> None:
    """An object entry's zip directory damaged (the manifest made to match): torch's reader of the objects finds it."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())  # our own file
    info = next(s for i, s in metadata.storage_data.items() if i.offset is None)
    _flip_at(folder / info.relative_path, info.offset + info.length - 22)  # its end-of-directory signature
    _refresh(folder)


# the choice blinded to the damage (the deep check of the entries patched out): every rank reads step 20, finds it
# damaged before anything changed, and every rank falls back to step 10 with the same decision
FOUND_WHEN_READ: dict[str, Callable[[Path], None]] = {"object_entry_damaged": _damage_object_entry}
REFUSED: dict[str, Callable[[Path], None]] = {
    "flipped_byte": lambda f: _flip(f, "__0_0.distcp"),  # rank 1's share of the CRC check: relayed to rank 0
    "uncovered_rows": _uncover,
}
