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
