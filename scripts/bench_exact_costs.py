#!/usr/bin/env python
"""What this round's exactness costs, beside the same run without it, in one process (ratios: the machine is noisy).

    python scripts/bench_exact_costs.py [--samples 4096] [--workers 2] [--rounds 3]

1. **One stream per sample** (docs/exact-resume.md): an epoch of a DataLoader with workers over a dataset whose
   ``__getitem__`` draws augmentation from the global streams (a 3x32x32 image: a crop, a flip, noise), registered
   with a CheckpointManager, ``ResumableDistributedSampler(sample_streams=True)`` against ``sample_streams=False``
   (torch's own worker streams). Median epoch time of ``--rounds`` epochs each, after one warm-up epoch.
2. **DDP's bucket layout replayed at a resume** (docs/exact-resume.md#ddp-buckets): ``resume`` of a DDP checkpoint
   into a new DDP (4 ranks on this machine's gloo), with the layout recorded against the same file without it;
   median of ``--rounds`` resumes, per rank, and the peak RSS growth of a rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_exact_rank import resume_rank

import dist_resume as dr
from dist_resume.testing import run_ranks


class Augmented(Dataset[torch.Tensor]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        image = torch.ones(3, 36, 36) * (index % 7)
        top, left = torch.randint(0, 5, (2,)).tolist()
        image = image[:, top : top + 32, left : left + 32]
        if torch.rand(1) < 0.5:
            image = image.flip(-1)
        return image + 0.05 * torch.randn(image.shape)


def _epoch_seconds(samples: int, workers: int, streams: bool, rounds: int) -> float:
    sampler = dr.ResumableDistributedSampler(samples, num_replicas=1, rank=0, sample_streams=streams)
    loader = DataLoader(
        Augmented(samples), batch_size=64, sampler=sampler, num_workers=workers, persistent_workers=True
    )
    with (
        tempfile.TemporaryDirectory() as folder,
        dr.CheckpointManager(folder, model=torch.nn.Linear(1, 1), dataloader=loader),
    ):
        times = []
        for _ in range(rounds + 1):
            start = time.perf_counter()
            for _batch in loader:
                pass
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ["DIST_RESUME_VERBOSITY"] = "warning"  # this process and the ranks: the figures alone
    dr.set_verbosity("warning")
    on = _epoch_seconds(args.samples, args.workers, True, args.rounds)
    off = _epoch_seconds(args.samples, args.workers, False, args.rounds)
    print(
        f"1. an epoch of {args.samples} augmented samples, {args.workers} workers: one stream per sample "
        f"{on:.3f} s, torch's worker streams {off:.3f} s: {on / off:.2f}x"
    )
    with tempfile.TemporaryDirectory() as folder:
        results: list[Any] = run_ranks(resume_rank, 4, args=(folder, args.rounds), timeout=300)
    replayed = statistics.median(r["replayed"] for r in results)
    plain = statistics.median(r["not"] for r in results)
    growth = max(r["rss_growth_mib"] for r in results)
    print(
        f"2. resume into a new DDP at 4 ranks (16 layers, 1 MiB buckets): with the layout replayed {replayed:.3f} s, "
        f"without {plain:.3f} s: {replayed / plain:.2f}x; a rank's peak RSS grew {growth:.1f} MiB over both"
    )


if __name__ == "__main__":
    main()
