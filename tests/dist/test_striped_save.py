"""A DDP save written by every rank into one ordinary torch file (the striped save), across real gloo processes."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from dist_resume._format.striped_archive import STRIPE_ALIGNMENT, plan_archive
from dist_resume._format.zip_layout import RecordSpec, plan_layout
from dist_resume._format.zip_verify import verify_zip
from dist_resume._format.zip_write import ZipWriter
from tests.dist import striped_save_workers as W
from tests.dist.harness import run_ranks, run_torchrun


def _records(path: Path) -> dict[str, tuple[bytes, int]]:
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None
        return {info.filename.split("/", 1)[1]: (zf.read(info), info.CRC) for info in zf.infolist()}


def _assert_same_records(striped: Path, rank0: Path) -> None:
    """The same names in the same order, the same data bytes and CRCs (but the pickle's time and the id)."""
    ours, theirs = _records(striped), _records(rank0)
    assert list(ours) == list(theirs)
    assert sum(name.startswith("data/") for name in ours) >= 20
    for name in ours:
        if name not in ("data.pkl", ".data/serialization_id"):
            assert ours[name] == theirs[name], name
    a, b = torch.load(striped, weights_only=True), torch.load(rank0, weights_only=True)
    a["meta"].pop("saved_at"), b["meta"].pop("saved_at")
    assert a.keys() == b.keys() and a["meta"] == b["meta"]
    for key in b["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_every_rank_writes_its_share_of_one_ordinary_file(tmp_path: Path) -> None:
    results = run_ranks(W.striped_checks, 2, tmp_path=tmp_path, args=(str(tmp_path),), deadline=150, pg_timeout=60)
    striped, rank0 = tmp_path / "striped.pt", tmp_path / "rank0.pt"
    # the bytes of the file: the rank-0 file's size; the striped file is as large once its alignment holes (never
    # written, no disk blocks) are left out
    size = rank0.stat().st_size
    assert abs(striped.stat().st_blocks * 512 - size) < size / 50, (striped.stat(), size)
    for res in results:  # every rank wrote at least a third of the file; the rank-0 save left rank 1 idle
        assert res["striped_written"] >= size / 3, (res["rank"], res["striped_written"], size)
        assert res["async_written"] >= size / 3, (res["rank"], res["async_written"], size)
    assert results[0]["rank0_written"] >= size and results[1]["rank0_written"] < size / 100
    for mmap in (False, True):
        loaded = torch.load(striped, weights_only=True, mmap=mmap)
        assert loaded["meta"]["step"] == 1 and loaded["model"]["0.weight"].shape == (768, 768)
    _assert_same_records(striped, rank0)
    assert verify_zip(striped) == []
    with zipfile.ZipFile(striped) as zf:  # the large records start on 1 MiB boundaries (the readers say so too)
        big = [i for i in zf.infolist() if i.file_size >= STRIPE_ALIGNMENT]
        assert len(big) >= 12
        with open(striped, "rb") as f:
            for info in big:
                f.seek(info.header_offset + 26)
                name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                assert (info.header_offset + 30 + name_len + extra_len) % STRIPE_ALIGNMENT == 0, info.filename

    # a failure on rank 1 mid-write: the same error on both ranks, nothing committed, no temporary file
    failures = [res["failure"] for res in results]
    assert failures[0] is not None and failures[0] == failures[1], failures
    kind, message, failed_rank = failures[0]
    assert kind == "CheckpointWriteError" and failed_rank == 1
    assert "rank(s) [1]" in message and "disk is full" in message and "ckpt_00000002.pt" in message
    lock = ".dist_resume.lock"  # the manager's write lock: no temporary file is left
    assert results[0]["after_failure"] == [lock, "ckpt_00000001.pt"], results[0]["after_failure"]
    assert results[0]["after_async"] == [lock, "ckpt_00000001.pt", "ckpt_00000003.pt"]
    assert torch.load(tmp_path / "run" / "ckpt_00000003.pt", weights_only=True)["meta"]["step"] == 3
    assert verify_zip(tmp_path / "run" / "ckpt_00000003.pt") == []

    # a folder rank 1 cannot see: one INFO line, rank 0 writes, and the decision is kept for the next save
    assert results[0]["hidden_lines"] == [results[0]["hidden_lines"][0]] and len(results[0]["hidden_lines"]) == 1
    assert results[1]["hidden_lines"] == []
    assert results[1]["hidden_written"] < size / 100
    assert results[0]["hidden_files"] == ["a.pt", "b.pt"]
    for name in ("a.pt", "b.pt"):
        assert torch.load(tmp_path / "hidden" / name, weights_only=True)["meta"]["world_size"] == 2
        assert verify_zip(tmp_path / "hidden" / name) == []


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(180)
def test_a_users_loop_under_torchrun_saves_striped(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(W.FILE_SCRIPT)
    out = run_torchrun([str(script), str(tmp_path / "run")], nproc=2, cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = tmp_path / "run" / "ckpt_00000003.pt"
    size = ckpt.stat().st_blocks * 512  # its alignment holes aside
    reports = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    for report in reports:
        assert report["written"] >= size / 3, (report, size)
    assert torch.load(ckpt, weights_only=True)["meta"]["step"] == 3
    assert verify_zip(ckpt) == []


def test_the_layout_of_64_aligned_records_is_torchs() -> None:
    """With no record aligned past 64 bytes, the planned offsets are the ones ZipWriter gives the same records."""
    sizes = [100, 0, 5, 70_000, 3, 1 << 16]
    layout = plan_layout([RecordSpec(f"archive/data/{i}", n) for i, n in enumerate(sizes)])
    fd = os.open(os.devnull, os.O_WRONLY)
    try:
        writer = ZipWriter(fd)
        offsets = []
        for i, n in enumerate(sizes):
            offsets.append(writer.offset)
            writer.add_bytes(f"archive/data/{i}", b"x" * n)
        assert [r.header_offset for r in layout.records] == offsets
        assert layout.central_offset == writer.offset
    finally:
        os.close(fd)


def test_shared_storages_are_one_record_as_torch_save_writes_them(tmp_path: Path) -> None:
    big = torch.randn(600, 1000)
    plan = plan_archive({"a": big, "view": big[10:20], "b": torch.zeros(3)})
    assert [(r.index, r.path, r.large) for r in plan.storages] == [(0, ("a",), True), (1, ("b",), False)]
    assert plan.storages[0].data_offset % STRIPE_ALIGNMENT == 0
