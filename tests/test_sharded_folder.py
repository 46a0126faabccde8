"""dist_resume's sharded checkpoint folder in one process: the format (manifest, train state, DCP files), conversion
to one file and back, and a manager folder treating ``ckpt_<step>.dcp/`` as one checkpoint (listing, latest,
integrity, rotation, leftovers, links). The folders here are written by ``convert`` (one process, full tensors);
tests/dist/test_fsdp_save.py writes them from FSDP2 ranks."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.manifest import MANIFEST, Manifest, file_crc32, read_manifest
from dist_resume._source.integrity import checkpoint_identity
from dist_resume.errors import CheckpointCorruptError, NotACheckpointError, UsageError


def _run(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(5, 3)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two payloads differ: keys and their order, types, values, tensors bit for bit (dtype included)."""
    if isinstance(a, torch.Tensor):
        same = isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return [] if same else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or list(a) != list(b):
            return [f"{path} keys"]
        if getattr(a, "_metadata", None) != getattr(b, "_metadata", None):
            return [f"{path} _metadata"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            return [f"{path} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _flip_byte(path: Path, offset: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_file_becomes_a_sharded_folder_and_back_bit_for_bit(tmp_path: Path) -> None:
    model, opt, sched = _run()
    src = dr.save_checkpoint(tmp_path / "a.pt", model=model, optimizer=opt, scheduler=sched, step=7, epoch=1)
    folder = tmp_path / "a.dcp"
    done = dr.tools.convert_checkpoint(src, folder, format="sharded")
    assert done.model_keys == 9 and done.param_names == 6  # 6 parameters and 3 BatchNorm buffers
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", MANIFEST, "train_state.pt"]
    manifest, raw = read_manifest(folder)
    body = json.loads(raw)
    assert body["format"] == "dist_resume.sharded" and body["format_version"] == 1
    assert (manifest.step, manifest.epoch, manifest.world_size, manifest.mesh_shape, manifest.writers) == (
        7,
        1,
        1,
        None,
        1,
    )
    assert manifest.contents == ("model", "optimizer")
    for entry in manifest.files:  # every file but the manifest, with its size and CRC-32
        assert (folder / entry.name).stat().st_size == entry.size and file_crc32(folder / entry.name) == entry.crc32
    assert {e.name for e in manifest.files} == {".metadata", "__0_0.distcp", "train_state.pt"}
    assert Manifest.from_json(manifest.to_json(), "here") == manifest

    info = dr.tools.inspect_checkpoint(folder)
    assert (info.step, info.layout, info.size) == (7, "dist_resume-sharded", manifest.size)
    assert checkpoint_identity(folder) == (info.size, info.digest)
    assert dr.tools.verify_archive(folder) == []

    back = tmp_path / "b.pt"
    assert dr.tools.convert_checkpoint(folder, back).layout.value == "dist_resume-sharded"
    original, again = torch.load(src, weights_only=True), torch.load(back, weights_only=True)
    assert _differences(original, again) == []  # keys, order, _metadata, every value and tensor

    # the folder resumes into a plain model as the file does; the second trip is the first's twin
    fresh, fresh_opt, fresh_sched = _run(seed=5)
    result = dr.resume(folder, model=fresh, optimizer=fresh_opt, scheduler=fresh_sched)
    assert result.step == 7 and result.layout.value == "dist_resume-sharded"
    assert _differences(model.state_dict(), fresh.state_dict()) == []
    assert _differences(opt.state_dict()["state"], fresh_opt.state_dict()["state"]) == []
    assert [dict(sorted(g.items())) for g in opt.state_dict()["param_groups"]] == [
        dict(sorted(g.items())) for g in fresh_opt.state_dict()["param_groups"]
    ]
    again_folder = tmp_path / "c.dcp"
    dr.tools.convert_checkpoint(back, again_folder, format="sharded")
    dr.tools.convert_checkpoint(again_folder, tmp_path / "c.pt")
    assert _differences(original, torch.load(tmp_path / "c.pt", weights_only=True)) == []

    with pytest.raises(UsageError, match="--to ddp does not apply"):
        dr.tools.convert_checkpoint(src, tmp_path / "d.dcp", "ddp", format="sharded")
    ddp_keys = torch.load(dr.tools.convert_checkpoint(folder, tmp_path / "ddp.pt", "ddp").dst, weights_only=True)
    assert all(k.startswith("module.") for k in ddp_keys["model"])


def test_damage_to_a_sharded_folder_is_found_and_named(tmp_path: Path) -> None:
    model, opt, _ = _run()
    folder = tmp_path / "a.dcp"
    dr.tools.convert_checkpoint(
        dr.save_checkpoint(tmp_path / "a.pt", model=model, optimizer=opt, step=3), folder, format="sharded"
    )
    shard = folder / "__0_0.distcp"

    _flip_byte(shard)
    assert dr.tools.inspect_checkpoint(folder, verify=False).step == 3  # sizes only: a flipped byte passes
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: CRC-32 [0-9a-f]{8}, the manifest says"):
        dr.tools.inspect_checkpoint(folder)
    (finding,) = dr.tools.verify_archive(folder, strict=False)
    assert finding.record == "__0_0.distcp" and finding.kind.value == "crc_mismatch"
    _flip_byte(shard)

    with open(shard, "ab") as f:
        f.write(b"x")
    with pytest.raises(CheckpointCorruptError, match=r"__0_0\.distcp: holds \d+ bytes, the manifest says"):
        dr.tools.inspect_checkpoint(folder, verify=False)
    with pytest.raises(CheckpointCorruptError, match=r"differs from its manifest\.json"):
        dr.resume(folder, model=_run(seed=1)[0])  # never read past a damaged manifest check
    os.truncate(shard, shard.stat().st_size - 1)

    (folder / MANIFEST).write_text("{not json")
    with pytest.raises(CheckpointCorruptError, match=r"manifest\.json is damaged"):
        dr.tools.inspect_checkpoint(folder)
    (folder / MANIFEST).unlink()
    with pytest.raises(NotACheckpointError, match=r"has no manifest\.json: its save did not finish"):
        dr.tools.inspect_checkpoint(folder)


def test_a_manifest_listing_a_file_by_a_rank_outside_its_world_size_is_damaged(tmp_path: Path) -> None:
    model, opt, _ = _run()
    folder = tmp_path / "a.dcp"
    dr.tools.convert_checkpoint(
        dr.save_checkpoint(tmp_path / "a.pt", model=model, optimizer=opt), folder, format="sharded"
    )
    body = json.loads((folder / MANIFEST).read_text())
    body["world_size"] = 2
    body["files"][0]["rank"] = 1
    Manifest.from_json(json.dumps(body).encode(), "here")  # rank 1 of 2: fine
    body["files"][0]["rank"] = 99
    (folder / MANIFEST).write_text(json.dumps(body))
    name = body["files"][0]["name"]
    with pytest.raises(
        CheckpointCorruptError, match=rf"manifest\.json is damaged .*world_size 2 \({name} by rank 99\)"
    ):
        dr.tools.inspect_checkpoint(folder)


def test_a_manager_folder_treats_a_sharded_folder_as_one_checkpoint(tmp_path: Path, caplog: Any) -> None:
    """Listing, latest (skipping a damaged or incomplete folder with its reason), rotation (a folder deleted whole,
    a link removed as a link), leftovers of killed folder saves removed, and the other form of a step superseded."""
    ckpts = tmp_path / "ckpts"
    model, opt, _ = _run()
    mgr = dr.CheckpointManager(ckpts, model=model, optimizer=opt, keep_last=2)
    mgr.save(100)

    def as_folder(step: int) -> Path:  # ckpt_<step>.dcp, as an FSDP2 save names it (here via convert)
        file = dr.save_checkpoint(tmp_path / f"{step}.pt", model=model, optimizer=opt, step=step)
        return Path(dr.tools.convert_checkpoint(file, ckpts / f"ckpt_{step:08d}.dcp", format="sharded").dst)

    folder = as_folder(200)
    assert [p.name for p in mgr.checkpoints()] == ["ckpt_00000100.pt", "ckpt_00000200.dcp"]
    assert mgr.latest() == folder
    assert dr.resume(ckpts, model=_run(seed=3)[0]).path == folder  # the folder is chosen and read

    _flip_byte(folder / "__0_0.distcp")
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert mgr.latest() == ckpts / "ckpt_00000100.pt"
    assert "ckpt_00000200.dcp" in caplog.text and "CRC-32" in caplog.text
    assert mgr.latest(verify=False) == folder  # sizes only
    _flip_byte(folder / "__0_0.distcp")

    incomplete = as_folder(400)
    (incomplete / MANIFEST).unlink()  # what a copy of a folder in progress looks like
    killed = ckpts / ".ckpt_00000300.dcp.0123456789abcdef.tmp"  # a save killed before its rename
    killed.mkdir()
    (killed / "__0_0.distcp").write_bytes(b"partial")
    outside = tmp_path / "kept"  # a link to a folder elsewhere: rotation removes the link, never the target
    dr.tools.convert_checkpoint(dr.save_checkpoint(tmp_path / "50.pt", model=model, step=50), outside, format="sharded")
    (ckpts / "ckpt_00000050.dcp").symlink_to(outside, target_is_directory=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dist_resume"):
        assert mgr.latest() == folder
    assert "ckpt_00000400.dcp" in caplog.text and "no manifest.json" in caplog.text

    mgr.save(300)  # keep_last=2: 300 and 200 stay, 100 and the link go, 400 (damaged) is left in place
    names = sorted(os.listdir(ckpts))
    assert names == [".dist_resume.lock", "ckpt_00000200.dcp", "ckpt_00000300.pt", "ckpt_00000400.dcp"], names
    assert (outside / MANIFEST).is_file()
    mgr.save(500)
    assert not folder.exists() and sorted(p.name for p in mgr.checkpoints()) == [
        "ckpt_00000300.pt",
        "ckpt_00000400.dcp",
        "ckpt_00000500.pt",
    ]
    as_folder(600)
    mgr.save(600)  # the same step as one file: the folder of step 600 is superseded
    assert not (ckpts / "ckpt_00000600.dcp").exists() and (ckpts / "ckpt_00000600.pt").is_file()
    mgr.close()
