#!/usr/bin/env python
"""What ``dist-resume list``, ``verify`` and ``import dist_resume`` cost, the torch path beside the torch-free one.

Builds a checkpoint folder with ``CheckpointManager`` (three ``ckpt_<step>.pt`` of a model of ``--width``-wide
Linear layers with AdamW state, ~50 MB each at the default width, and one sharded ``ckpt_<step>.dcp/`` made by
``convert --format sharded``), then times each command as a user runs it (a fresh ``python`` process: the import
is part of the cost), the median of ``--repeat`` interleaved runs, page cache warm:

- ``import dist_resume``: the lazy import (fast) beside touching one name (``dist_resume.resume``), which loads
  every public name and torch, as the eager import of 0.2 did;
- ``list DIR``, ``list --verify DIR`` and ``verify A B`` (two copies of one file): the CLI as it is (fast) beside the
  same CLI with its fast paths switched off (``fast_entries``/``fast_verify`` made to decline), i.e. the torch path.

Prints a table and a JSON document; deletes its files.

    python scripts/bench_cli.py                 # about a minute on 2 busy cores, ~250 MB of disk
    python scripts/bench_cli.py --repeat 9 --width 512
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# the torch path: the CLI with both fast paths declining (the fallback every doubtful input takes)
_TORCH_PATH = (
    "import sys\n"
    "from dist_resume._format.peek import PeekUnsure\n"
    "import dist_resume.cli._list as l, dist_resume.cli._verify as v\n"
    "def decline(*args, **kwargs):\n"
    "    raise PeekUnsure('benchmark: the torch path')\n"
    "l.fast_entries = v.fast_verify = decline\n"
    "from dist_resume.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)
_FAST_PATH = "import sys\nfrom dist_resume.cli import main\nsys.exit(main(sys.argv[1:]))\n"


def _build(root: Path, width: int) -> tuple[Path, Path, Path]:
    import torch
    from torch import nn

    import dist_resume as dr

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width) for _ in range(4)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    folder = root / "ckpts"
    with dr.CheckpointManager(folder, model=model, optimizer=opt, keep_last=5) as mgr:
        for step in (100, 200, 300):
            mgr.save(step, epoch=step // 100)
    src = dr.save_checkpoint(root / "src.pt", model=model, optimizer=opt, step=400, epoch=4)
    dr.tools.convert_checkpoint(src, folder / "ckpt_00000400.dcp", format="sharded")
    a = folder / "ckpt_00000300.pt"
    b = root / "copy.pt"
    b.write_bytes(a.read_bytes())
    return folder, a, b


def _time(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    start = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{argv} failed ({done.returncode}): {done.stderr[-2000:]}")
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5, help="runs per command (the median is shown)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (4 layers; 1024: ~50 MB per file)")
    args = parser.parse_args()
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        folder, a, b = _build(Path(tmp), args.width)
        size = a.stat().st_size
        cases = {
            "import dist_resume": (
                [py, "-c", "import dist_resume; dist_resume.resume"],
                [py, "-c", "import dist_resume"],
            ),
        }
        for name, cli in (
            ("list DIR", ["list", str(folder)]),
            ("list --verify DIR", ["list", "--verify", str(folder)]),
            ("verify A B", ["verify", str(a), str(b)]),
        ):
            cases[name] = ([py, "-c", _TORCH_PATH, *cli], [py, "-c", _FAST_PATH, *cli])
        times: dict[str, dict[str, list[float]]] = {n: {"torch": [], "fast": []} for n in cases}
        for _ in range(args.repeat):  # interleaved: a busy neighbour slows both paths alike
            for name, (slow, fast) in cases.items():
                times[name]["torch"].append(_time(slow))
                times[name]["fast"].append(_time(fast))
    rows = {
        name: {path: round(statistics.median(ts), 3) for path, ts in by_path.items()} for name, by_path in times.items()
    }
    print(f"checkpoint files of {size / 2**20:.1f} MiB, median of {args.repeat} runs, python {sys.version.split()[0]}")
    print(f"{'command':<20} {'torch path':>11} {'fast path':>10} {'ratio':>7}")
    for name, row in rows.items():
        print(f"{name:<20} {row['torch']:>10.3f}s {row['fast']:>9.3f}s {row['torch'] / row['fast']:>6.1f}x")
    print(json.dumps({"file_bytes": size, "repeat": args.repeat, "seconds": rows}, indent=2))


if __name__ == "__main__":
    main()
