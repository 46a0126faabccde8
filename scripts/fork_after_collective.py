"""How often a fork right after a gloo collective makes a child that hangs before it runs (CPython gh-112275), in plain
torch processes and in the same processes with ``dist_resume`` imported (its before-fork handler: _core/fork.py).

    python scripts/fork_after_collective.py [--forks 4000] [--load 3]

Each arm is one ``torchrun --standalone`` launch of 2 ranks; each rank, ``--forks`` times: a DDP forward and backward
(one all-reduce), an object all-gather (what a save's agreement is), then at once ``os.fork()``, whose child exits at
once; a child not gone within 3 s is counted and killed. The hang needs the lock to be held at the fork, so ``--load``
busy processes share the cores meanwhile (more processes than cores, as a test suite's). Prints both arms side by side.
Measured on a 2-core machine, CPython 3.11.7, torch 2.13 (docs/exact-resume.md#dataloader-workers-that-hang-as-they-start).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time


def _rank(forks: int, with_dist_resume: bool) -> None:
    """One rank's loop; prints ``hung H of N``."""
    import torch
    import torch.distributed as dist

    if with_dist_resume:
        import dist_resume  # noqa: F401  its import registers the before-fork handler
    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    hung = 0
    for i in range(forks):
        model(torch.randn(2, 4)).sum().backward()
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, i)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        deadline = time.monotonic() + 3.0
        while not os.waitpid(pid, os.WNOHANG)[0]:
            if time.monotonic() > deadline:
                hung += 1
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.0005)
    print(f"rank {dist.get_rank()}: hung {hung} of {forks}", flush=True)
    dist.destroy_process_group()


def _arm(forks: int, with_dist_resume: bool) -> tuple[int, int]:
    """(hung, forks) over both ranks of one launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if with_dist_resume:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__]
    cmd += ["--rank", str(forks), *(["--with-dist-resume"] if with_dist_resume else [])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=forks * 0.2 + 120, check=True).stdout
    counts = [(int(h), int(n)) for h, n in re.findall(r"hung (\d+) of (\d+)", out)]
    if len(counts) != 2:
        raise RuntimeError(f"expected two ranks' counts, got:\n{out}")
    return sum(h for h, _ in counts), sum(n for _, n in counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forks", type=int, default=4000, help="forks per rank and arm")
    parser.add_argument("--load", type=int, default=3, help="busy processes sharing the cores")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--with-dist-resume", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        _rank(args.rank, args.with_dist_resume)
        return
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        plain = _arm(args.forks, with_dist_resume=False)
        guarded = _arm(args.forks, with_dist_resume=True)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"Python {sys.version.split()[0]}, {os.cpu_count()} cores, {args.load} busy processes")
    print(f"{'':<28}{'hung':>6}{'forks':>8}")
    print(f"{'plain torch':<28}{plain[0]:>6}{plain[1]:>8}")
    print(f"{'with dist_resume imported':<28}{guarded[0]:>6}{guarded[1]:>8}")


if __name__ == "__main__":
    main()
