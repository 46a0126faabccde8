#!/usr/bin/env python
"""What a small hostile file costs a resume: the probe's case of issue 45, a sound checkpoint whose Python RNG state is
a tensor expanded (stride 0) over one stored int to ``n`` elements. A file of some 13 KB whatever ``n``; before 0.5
validation walked every element (``tuple()`` of the tensor). Each figure is printed beside ``n`` and the file's size:
the cost must follow the file's bytes, not ``n``.

    python scripts/bench_hostile_cost.py                      # n = 10**6, 10**7, 10**8: a few seconds
    python scripts/bench_hostile_cost.py --n 1000000 3000000  # other sizes (run it on an older checkout to compare)
"""

from __future__ import annotations

import argparse
import logging
import resource
import tempfile
import time
import warnings
from pathlib import Path

import torch

import dist_resume as dr


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, nargs="+", default=[10**6, 10**7, 10**8], help="elements of the tensor")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    logging.getLogger("dist_resume").setLevel(logging.CRITICAL)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tempfile.TemporaryDirectory() as tmp:
        good = dr.save_checkpoint(Path(tmp) / "good.pt", model=model, optimizer=opt, rng=True)
        for n in args.n:
            obj = torch.load(good, weights_only=True)
            version, _, gauss = obj["rng"][0]["python"]
            obj["rng"][0]["python"] = [version, torch.zeros(1, dtype=torch.int64).expand(n), gauss]
            path = Path(tmp) / f"expanded-{n}.pt"
            torch.save(obj, path)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            start = time.perf_counter()
            try:
                dr.resume(path, model=model, optimizer=opt)
                said = "resumed"
            except dr.DistResumeError as err:
                said = f"refused ({type(err).__name__})"
            seconds = time.perf_counter() - start
            grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak) // 1024
            print(
                f"n = {n:>11,}: a {path.stat().st_size / 1024:.1f} KB file {said} in {seconds:.3f} s, peak memory +{grown} MB"
            )


if __name__ == "__main__":
    main()
