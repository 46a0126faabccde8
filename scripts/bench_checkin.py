#!/usr/bin/env python
"""What the check-in before every collective entry costs a DDP save (issue 35).

Runs itself under ``torchrun --standalone`` (a TCPStore, as every torchrun job has) at 2 and 4 CPU ranks with gloo. Each
rank times, in interleaved rounds, ``CheckpointManager.save`` of a 4 MiB model (one 1024x1024 Linear, SGD with
momentum) with the check-in and with it switched off (the 0.4.0 path), and the check-in alone; rank 0 prints the
medians side by side and the ratio of the two saves.

    python scripts/bench_checkin.py                # about a minute on 2 cores
    python scripts/bench_checkin.py --rounds 40 --ranks 2 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

WORKER_ENV = "BENCH_CHECKIN_WORKER"


def _worker(folder: str, rounds: int) -> None:
    import torch
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._dist import checkin
    from dist_resume._manager import manager as manager_module

    dr.init_distributed()
    dr.set_verbosity("warning")  # no line per save
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1024, 1024))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt, keep_last=1)
    times: dict[str, list[float]] = {"save": [], "save without check-in": [], "check-in alone": []}

    def timed(name: str, fn: Callable[..., object], *args: object) -> None:
        dist.barrier()
        start = time.perf_counter()
        fn(*args)
        times[name].append(time.perf_counter() - start)

    for round_ in range(rounds):
        timed("save", mgr.save, 2 * round_)
        vars(manager_module)["check_in"] = lambda *a, **k: None  # the 0.4.0 path
        timed("save without check-in", mgr.save, 2 * round_ + 1)
        vars(manager_module)["check_in"] = checkin.check_in
        timed("check-in alone", checkin.check_in, "bench")
    mgr.close()
    if dist.get_rank() == 0:
        with_ms = statistics.median(times["save"]) * 1e3
        without_ms = statistics.median(times["save without check-in"]) * 1e3
        alone_ms = statistics.median(times["check-in alone"]) * 1e3
        print(
            f"{dist.get_world_size()} ranks: save {with_ms:.1f} ms, without check-in {without_ms:.1f} ms "
            f"(ratio {with_ms / without_ms:.3f}); check-in alone {alone_ms:.3f} ms "
            f"({100 * alone_ms / without_ms:.2f}% of a save); medians of {rounds} rounds",
            flush=True,
        )
    dr.destroy_distributed()


def main() -> None:
    if os.environ.get(WORKER_ENV):
        _worker(sys.argv[1], int(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    for n in args.ranks:
        with tempfile.TemporaryDirectory(prefix="bench_checkin.") as tmp:
            env = {**os.environ, WORKER_ENV: "1", "OMP_NUM_THREADS": "1"}
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
            subprocess.run([*cmd, __file__, os.path.join(tmp, "run"), str(args.rounds)], env=env, check=True)


if __name__ == "__main__":
    main()
