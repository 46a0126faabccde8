"""broadcast_from_rank0 reads the file once, on rank 0; every rank restores into its own tensors (2-rank gloo)."""

from __future__ import annotations

import os

import pytest
import torch

import dist_resume
from tests.dist import perf_workers as P
from tests.dist.ddp_workers import flat_state
from tests.dist.harness import run_ranks

pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="reads Linux /proc/self/io"),
]

STRAY = 64 * 1024  # reads that are not the checkpoint (a few hundred bytes seen); the file is ~3 MiB


def test_broadcast_reads_the_file_once_and_each_rank_restores_in_place(tmp_path):
    model, opt = P.make(seed=0)
    P.train(model, opt, steps=3)
    ckpt = tmp_path / "c.pt"
    dist_resume.save_checkpoint(ckpt, model=model, optimizer=opt, step=3)
    size = ckpt.stat().st_size
    expected = flat_state(model, opt)
    results = run_ranks(P.reads, 2, tmp_path=tmp_path, args=(str(ckpt),), deadline=120, pg_timeout=60)
    rank0, rank1 = results
    # broadcast_from_rank0, mmap=False: rank 0 reads the file once, rank 1 not at all
    assert size <= rank0["broadcast"]["rchar"] <= size + STRAY, (size, rank0["broadcast"]["rchar"])
    assert rank1["broadcast"]["rchar"] < STRAY, rank1["broadcast"]["rchar"]
    # control: without broadcast the same counter sees each rank read the whole file
    for rank, res in enumerate(results):
        assert size <= res["each"]["rchar"] <= size + STRAY, (rank, size, res["each"]["rchar"])
    for rank, res in enumerate(results):
        for phase, got in res.items():
            assert got["same_tensors"], f"rank {rank}, {phase}: a parameter or buffer was replaced, not copied into"
            assert not got["file_still_mapped"], f"rank {rank}, {phase}: something still maps the checkpoint"
            assert got["state"].keys() == expected.keys()
            for key, value in expected.items():
                assert torch.equal(got["state"][key], value), (rank, phase, key)


LAYERS = 4  # a 64 MiB model (16 MiB per weight), 192 MiB with its AdamW state
MIB = 2**20


@pytest.mark.timeout(200)
def test_resume_grows_no_rank_by_more_than_one_bucket(tmp_path):
    """All or nothing costs no copy of the model on any rank: a file, a folder (the ranks agree before the data is
    written), broadcast_from_rank0 (the data received straight into the live tensors, one bucket: here the largest
    tensor, 16 MiB) and an FSDP2 resume each grow a rank's allocated memory by far less than the 64 MiB model; a fresh
    optimizer's resume by the state it must create (measured with glibc's mallinfo2: RssAnon hides an allocation that
    reuses pages freed before; 0.3.0 grew 64 MiB for the folder, 64 and 256 MiB for the broadcast)."""
    results = run_ranks(
        P.resume_memory, 2, tmp_path=tmp_path, args=(str(tmp_path / "run"), LAYERS), deadline=180, pg_timeout=90
    )
    state = 2 * LAYERS * 16 * MIB  # AdamW's exp_avg and exp_avg_sq: what a fresh optimizer must create
    bounds = {"broadcast": 24 * MIB, "folder_fresh_optimizer": state + 8 * MIB}  # a bucket; the state it creates
    for rank, growth in enumerate(results):
        assert growth.keys() == {"file", "folder", "broadcast", "folder_fresh_optimizer", "fsdp2"}
        for path, grown in growth.items():
            bound = bounds.get(path, 8 * MIB)  # else small states only
            assert grown <= bound, f"rank {rank}, {path}: grew {grown / MIB:.1f} MiB, bound {bound / MIB:.0f} MiB"
        assert growth["folder_fresh_optimizer"] >= state  # the measure sees what is allocated
