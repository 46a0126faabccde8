"""``dist-resume inspect``, ``verify``, ``list`` and ``convert`` of sharded checkpoint folders (what FSDP2 saves):
the world size and mesh the save had, each rank's shards, completeness against the manifest (sizes and CRC-32s),
damage named by file.

The folders are made in one process, as tests/test_sharded_folder.py makes them (``convert --format sharded``),
then given the manifest and train state a 2-rank FSDP2 save writes (world size 2, a 1-D mesh, rank 1's
``__1_0.distcp`` listed with its size and CRC-32): what the CLI reads is the manifest and the files it lists, so no launch is needed.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.manifest import MANIFEST, TRAIN_STATE, file_entry, read_manifest
from dist_resume._source.listing import sharded_checkpoint_name
from dist_resume.cli import main


def _two_rank_folder(root: Path, step: int = 20) -> tuple[Path, Path]:
    """(a ckpt_<step>.dcp folder whose manifest says 2 ranks wrote it on a 2-way mesh, the file it was made from)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.named_parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    (root / "ckpts").mkdir(parents=True, exist_ok=True)
    src = Path(dr.save_checkpoint(root / "src.pt", model=model, optimizer=opt, step=step, epoch=2))
    folder = Path(
        dr.tools.convert_checkpoint(src, root / "ckpts" / sharded_checkpoint_name(step), format="sharded").dst
    )
    shard = folder / "__1_0.distcp"
    shard.write_bytes(b"rank 1's shards" * 64)
    train_state = torch.load(folder / TRAIN_STATE, weights_only=True)
    train_state["meta"]["world_size"] = 2
    torch.save(train_state, folder / TRAIN_STATE)
    manifest, _ = read_manifest(folder)
    files = tuple(file_entry(folder / f.name, f.rank) for f in manifest.files) + (file_entry(shard, 1),)
    manifest = dataclasses.replace(
        manifest, world_size=2, mesh_shape=(2,), mesh_dim_names=("dp",), writers=2, files=files
    )
    (folder / MANIFEST).write_bytes(manifest.to_json())
    return folder, src


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_the_world_size_mesh_shards_and_completeness(tmp_path, capsys):
    folder, _ = _two_rank_folder(tmp_path)
    code, out, err = _run(capsys, "inspect", str(folder))
    assert code == 0 and not err
    lines = {line.split()[0]: line for line in out.splitlines() if line and not line.startswith(" ")}
    assert (
        "written at world size 2, mesh 2 (dp); 2 writing rank(s), 2 shard file(s); holds model, optimizer"
        in (lines["sharded"])
    )
    assert "rank 0: .metadata, __0_0.distcp, train_state.pt (" in lines["shards"]
    assert "; rank 1: __1_0.distcp (960 B)" in lines["shards"]
    assert lines["complete"] == "complete     yes: 4 files, each with the size and CRC-32 its manifest lists"
    assert "step=20 epoch=2" in lines["meta"]
    assert lines["tensor"] == "tensor data  read on the CPU (torch's DCP reader)"  # not memory-mapped: read whole
    code, out, _ = _run(capsys, "inspect", "--json", str(folder))
    sharded = json.loads(out)["sharded"]
    assert (sharded["world_size"], sharded["mesh_shape"], sharded["mesh_dim_names"], sharded["writers"]) == (
        2,
        [2],
        ["dp"],
        2,
    )
    assert [(r["rank"], r["files"][-1]) for r in sharded["ranks"]] == [(0, "train_state.pt"), (1, "__1_0.distcp")]
    assert (sharded["step"], sharded["epoch"], sharded["complete"]) == (20, 2, True)
    code, out, _ = _run(capsys, "inspect", "--json", str(tmp_path / "src.pt"))
    assert json.loads(out)["sharded"] is None


def _damage(folder: Path, how: str) -> None:
    shard = folder / "__1_0.distcp"
    if how == "flipped":
        raw = bytearray(shard.read_bytes())
        raw[10] ^= 0xFF
        shard.write_bytes(bytes(raw))
    elif how == "truncated":
        shard.write_bytes(shard.read_bytes()[:100])
    elif how == "missing":
        shard.unlink()
    else:
        (folder / MANIFEST).unlink()


@pytest.mark.parametrize(
    ("how", "words"),
    [
        ("flipped", "__1_0.distcp: CRC-32"),
        ("truncated", "__1_0.distcp: holds 100 bytes, the manifest says 960"),
        ("missing", "__1_0.distcp: is missing"),
        ("no manifest", "has no manifest.json: its save did not finish"),
    ],
)
def test_inspect_verify_and_list_name_the_damaged_file(tmp_path, capsys, how, words):
    folder, src = _two_rank_folder(tmp_path)
    _damage(folder, how)
    for argv in (("inspect", str(folder)), ("verify", str(folder), str(src)), ("verify", str(src), str(folder))):
        code, out, err = _run(capsys, *argv)
        assert code == 2 and not out, argv
        assert words in err and str(folder) in err, (argv, err)
    code, out, _ = _run(capsys, "list", "--verify", "--json", str(folder.parent))
    row = json.loads(out)["checkpoints"][0]
    assert row["status"] == "damaged" and row["shards"] is None
    assert ("manifest.json" if how == "no manifest" else "__1_0.distcp") in row["reason"]


def test_verify_compares_a_sharded_folder_with_files_and_list_shows_its_shards(tmp_path, capsys):
    folder, src = _two_rank_folder(tmp_path)
    code, out, err = _run(capsys, "verify", str(folder), str(src))
    assert code == 0 and not err
    assert out.splitlines()[:2] == [
        "equal: 2 model and 6 optimizer tensors compared",
        "  A: dist_resume-sharded, prefix none; model <- 'model', optimizer <- 'optimizer'",
    ]
    code, out, _ = _run(capsys, "list", str(folder.parent))
    row = next(line for line in out.splitlines() if sharded_checkpoint_name(20) in line)
    assert row.split()[1:3] == ["20", "2"] and row.split()[7] == "2"  # step, epoch; the world size it was saved at
    assert row.endswith("valid (sharded: 2 shard file(s) by 2 rank(s), mesh 2)")
    code, out, _ = _run(capsys, "list", "--json", str(folder.parent))
    assert json.loads(out)["checkpoints"][0]["shards"] == {"shard_files": 2, "writers": 2, "mesh_shape": [2]}


def test_convert_turns_a_sharded_folder_into_one_file_and_back(tmp_path, capsys):
    folder, src = _two_rank_folder(tmp_path)
    one = tmp_path / "one.pt"
    assert _run(capsys, "convert", str(folder), str(one), "--format", "pt")[0] == 0
    assert _run(capsys, "verify", str(one), str(src))[0] == 0
    back = tmp_path / "back" / sharded_checkpoint_name(20)
    back.parent.mkdir()
    assert _run(capsys, "convert", str(one), str(back), "--format", "sharded")[0] == 0
    code, out, _ = _run(capsys, "verify", str(back), str(folder))
    assert code == 0 and out.startswith("equal: ")
