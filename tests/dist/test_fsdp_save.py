"""Saving from FSDP2 (fully_shard on a CPU mesh, gloo): the sharded checkpoint folder (DCP files, train state, manifest,
one rename), ``full_state=True`` files, ``convert`` both ways, failures on one rank, rotation and damage, async saves.

One test, two launches: 2 ranks (1-D mesh), then 4 ranks (2x2 HSDP) which also loads the 2-rank folder.
"""

from __future__ import annotations

import json

import pytest

from tests.dist import fsdp_save_workers as SW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

SHARDED_FILES = {".metadata", "manifest.json", "train_state.pt"}


def _check(results: list[dict], world_size: int) -> None:
    zero = results[0]
    shards = {f"__{r}_0.distcp" for r in range(world_size)}
    assert zero["files"] == sorted(SHARDED_FILES | shards), zero["files"]
    assert zero["manifest_files"] == sorted((SHARDED_FILES - {"manifest.json"}) | shards)
    mesh = [2] if world_size == 2 else [2, 2]
    assert zero["manifest"] == {
        "format": "dist_resume.sharded",
        "step": 100,
        "world_size": world_size,
        "mesh_shape": mesh,
        "writers": world_size,
    }
    assert zero["latest"] == "ckpt_00000100.dcp" and zero["info"] == (100, "dist_resume-sharded", True)
    assert zero["dcp_keys_canonical"] and zero["optimizer_by_name"]
    assert zero["train_state_keys"] == [
        "format",
        "format_version",
        "meta",
        "rng",
        "sampler",
        "scheduler",
        "sharded_layout",
    ]
    assert zero["sampler"] == 5 * world_size and zero["scheduler"] and zero["rng_ranks"] == world_size
    assert zero["rng0_is_rank0s"]
    assert zero["full_keys"] == ["format", "format_version", "meta", "model", "optimizer", "rng", "scheduler"]
    assert zero["full_rng_ranks"] == world_size
    for check in (
        "plain_vs_dsd",
        "full_vs_dsd",
        "full_resumed_vs_dsd",
        "conv_vs_dsd",
        "round_trip",
        "compiled_keys_canonical",
    ):
        assert zero[check] in ([], True), (check, zero[check])
    if world_size == 4:
        assert zero["earlier_vs_its_dsd"] == []  # saved at 2 ranks, loaded at 4
        assert zero["flat_into_hsdp"] == [] and zero["hsdp_into_flat"] == []
    for rank, r in enumerate(results):
        assert r["first"] == "ckpt_00000100.dcp" and r["rng_untouched"], rank
        assert "is named like a file" in r["file_name"], rank
        for check in ("dcp_load", "dcp_load_root_only", "kept", "back_into_fsdp", "async_vs_before", "compiled"):
            assert r[check] == [], (rank, check, r[check])
        assert r["plain_resume"] == ("ckpt_00000100.dcp", 100, "dist_resume-sharded"), rank
        assert r["full_manager"] == "ckpt_00000100.pt" and r["async"] == "ckpt_00000200.dcp"
        assert r["damaged_skipped"] == "ckpt_00000200.dcp", rank  # 300's last shard has a flipped byte
    _check_cli(zero, world_size, mesh)
    assert zero["after_rotation"] == [".dist_resume.lock", "ckpt_00000200.dcp", "ckpt_00000300.dcp"]
    victims = {"dcp_write": world_size - 1, "read_back": world_size - 1, "commit": 0}
    causes = {"dcp_write": "the disk is full", "read_back": "Input/output error", "commit": "permission denied"}
    for where, victim in victims.items():
        outcomes = [r["failures"][where] for r in results]
        messages = {o["message"].replace(" (reported by rank 0)", "") for o in outcomes}
        assert len(messages) == 1, (where, messages)  # every rank raises the same error
        (message,) = messages
        assert all(o["error"] == "CheckpointWriteError" for o in outcomes), where
        assert causes[where] in message and "ckpt_00000200.dcp" in message, (where, message)
        assert [o["rank"] for o in outcomes if o["rank"] is not None] and all(
            o["rank"] in (victim, None) for o in outcomes
        ), (where, [o["rank"] for o in outcomes])
        assert zero["failures"][where]["entries"] == [".dist_resume.lock", "ckpt_00000100.dcp"], where
        assert zero["failures"][where]["latest"] == "ckpt_00000100.dcp", where


def _check_cli(zero: dict, world_size: int, mesh: list[int]) -> None:
    """``dist-resume inspect``, ``list`` and ``verify`` on the folder the ranks wrote, and on the damaged one."""
    code, out, err = zero["cli_inspect"]
    assert code == 0 and not err, (code, err)
    sharded = json.loads(out)["sharded"]
    assert (sharded["world_size"], sharded["mesh_shape"], sharded["writers"], sharded["complete"]) == (
        world_size,
        mesh,
        world_size,
        True,
    ), sharded
    owned = {r["rank"]: r["files"] for r in sharded["ranks"]}
    assert sorted(owned) == list(range(world_size)), owned
    assert all(f"__{rank}_0.distcp" in files for rank, files in owned.items()), owned
    code, out, err = zero["cli_list"]
    assert code == 0 and not err, (code, err)
    (row,) = json.loads(out)["checkpoints"]
    assert row["status"] == "valid" and row["shards"] == {
        "shard_files": world_size,
        "writers": world_size,
        "mesh_shape": mesh,
    }, row
    code, out, err = zero["cli_verify"]
    assert code == 0 and not err and out.startswith("equal: 7 model and 18 optimizer tensors compared"), (out, err)
    (code, out, err), (list_code, list_out, _) = zero["cli_damaged"]
    last = f"__{world_size - 1}_0.distcp"
    assert code == 2 and not out and f"{last}: CRC-32" in err and "ckpt_00000300.dcp" in err, (code, err)
    rows = {r["name"]: r for r in json.loads(list_out)["checkpoints"]}
    assert rows["ckpt_00000300.dcp"]["status"] == "damaged" and last in rows["ckpt_00000300.dcp"]["reason"], rows
    assert rows["ckpt_00000200.dcp"]["status"] == "valid", rows


def test_fsdp2_saves_sharded_folders_and_full_files_at_2_then_4_ranks(tmp_path):
    two = run_ranks(SW.sharded_saves, 2, tmp_path=tmp_path, args=(str(tmp_path), None), deadline=220, pg_timeout=90)
    _check(two, 2)
    earlier = str(tmp_path / "ws2" / "kept.dcp")
    four = run_ranks(SW.sharded_saves, 4, tmp_path=tmp_path, args=(str(tmp_path), earlier), deadline=220, pg_timeout=90)
    _check(four, 4)
