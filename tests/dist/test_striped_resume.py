"""A DDP resume of a local file, striped (issue 38): each rank reads its share of the tensor records and the ranks
exchange them; every rank ends bitwise with the file's values, reading at most two thirds of it; failures are the
same typed error on every rank. One launch per group of checks."""

from __future__ import annotations

import pytest
import torch

import dist_resume
from dist_resume._dist.striped_exchange import IN_PLACE_BYTES, _messages, owners_by_bytes
from tests.dist import striped_resume_workers as S
from tests.dist.harness import REPO_ROOT, run_ranks, run_torchrun

pytestmark = pytest.mark.dist


def test_owners_are_contiguous_and_balanced_by_bytes():
    sizes = [100, 5, 5, 300, 50, 50, 200, 290]
    for world in (1, 2, 3, 4):
        owners = owners_by_bytes(sizes, world)
        assert owners == sorted(owners) and set(owners) <= set(range(world))
        share = [sum(n for n, o in zip(sizes, owners) if o == r) for r in range(world)]
        assert max(share) - sum(sizes) / world <= max(sizes) / 2, (world, share)
    assert owners_by_bytes([0, 0], 2) == [0, 0]


def test_messages_pack_small_tensors_and_send_large_ones_in_place_in_bounded_pieces():
    sizes = [3, IN_PLACE_BYTES * 3, 10, 0, 7]
    owners = [0, 0, 1, 1, 1]
    messages = _messages(sizes, owners, 2, bucket_bytes=IN_PLACE_BYTES * 2)
    alone = [m for m in messages if m.alone]
    assert [m.nbytes for m in alone] == [IN_PLACE_BYTES * 2, IN_PLACE_BYTES]  # the large one, in two pieces
    packed = [m for m in messages if not m.alone]
    assert [[p.unit for p in m.pieces] for m in packed] == [[0], [2, 4]]  # the empty one moves nothing
    assert [p.offset % 16 for m in packed for p in m.pieces] == [0, 0, 0]
    assert all(m.nbytes <= IN_PLACE_BYTES * 2 for m in messages)


def test_striped_resume_is_bitwise_and_each_rank_reads_its_share(tmp_path):
    results = run_ranks(S.resumes, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"),), deadline=150)
    for rank, res in enumerate(results):
        for case in ("manager", "fresh", "every_rank", "plain"):
            step, restored, bad = res[case]
            assert bad == [], f"rank {rank}, {case}: {bad}"
            assert "model" in restored and "optimizer" in restored and "scheduler" in restored, (case, restored)
        assert res["manager"][0] == 3 and res["fresh"][0] == 3
        for case, size in (("manager", res["size"]), ("fresh", res["size"]), ("plain", res["plain_size"])):
            read = res[f"{case}_read"]
            assert 0 < read <= 2 * size / 3, f"rank {rank}, {case}: read {read} of {size} bytes"
    # the shares cover the tensor data: together the ranks read all of it, about half each
    assert sum(res["manager_read"] for res in results) >= results[0]["tensor_bytes"]
    # rank 0 too touches its share only, the pages it maps counted with the bytes it reads (it mapped the whole file
    # to check every CRC-32 before it chose it)
    for rank, res in enumerate(results):
        touched = res["manager_read"] + res["manager_mapped"]
        assert touched <= 0.65 * res["size"], f"rank {rank}: read {res['manager_read']}, mapped {res['manager_mapped']}"


def test_a_damaged_record_or_a_failed_read_is_the_same_error_on_every_rank(tmp_path):
    (tmp_path / "f").mkdir()
    results = run_ranks(S.faults, 2, tmp_path=tmp_path, args=(str(tmp_path / "f"),), deadline=150)
    for rank, res in enumerate(results):
        assert res["verify"] == "CheckpointCorruptError", (rank, res.get("verify_message"))
        assert res["verify_unchanged"], f"rank {rank} changed its model or optimizer before refusing the file"
        assert res["manager_fallback"] == 2, (rank, res["manager_fallback"])  # the damaged newest skipped
        assert res["commit"] == "PartialRestoreError", (rank, res.get("commit_message"))
    assert "rank(s) [1]" in results[0]["commit_message"] and "injected" in results[1]["commit_message"]
    assert "CRC" in results[0]["verify_message"] + results[1]["verify_message"]


@pytest.mark.slow
def test_a_user_script_under_torchrun_resumes_striped(tmp_path):
    model = S.Big()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    path = dist_resume.save_checkpoint(tmp_path / "c.pt", model=model, optimizer=opt, scheduler=sched, step=1)
    script = REPO_ROOT / "tests" / "dist" / "striped_resume_workers.py"
    out = run_torchrun([str(script), str(path)], nproc=2, cwd=tmp_path, timeout=150)
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} step 1 differences []" in out.stdout, out.stdout[-2000:]
