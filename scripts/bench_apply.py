"""What all-or-nothing resume costs on the DDP path: per-rank memory and time, beside earlier releases, in one run.

Usage::

    python scripts/bench_apply.py [--mib 256] [--ranks 2] [--repeat 3] [--versions 0.2=7b8b64e,0.3.0=856d0ab]

Each version (a git revision of this repository, extracted with ``git archive``; ``now`` is the working tree) saves
one checkpoint of a ``--mib`` MiB model (float32 ``Linear`` layers, 16 MiB each) with warm AdamW state from
``--ranks`` gloo processes, then resumes it into the same model, trained state present, in fresh processes:

- ``file``: ``dist_resume.resume(<the file>)`` on every rank (each rank reads it itself);
- ``folder``: ``CheckpointManager.resume()`` (collective: rank 0 chooses, the ranks agree);
- ``broadcast``: the same with ``broadcast_from_rank0`` (rank 0 reads, the others receive);
- ``fsdp2``: the folder into the model sharded with ``fully_shard`` (versions that have FSDP2 resume).

Printed per variant and version: the median time of the call and each rank's peak RssAnon growth during it (sampled
from the parent every 2 ms; the file is memory-mapped, so its pages are RssFile, not RssAnon), then each version's
time as a ratio of the first version's. The versions' runs are interleaved (each repeat runs every variant of every
version once), so that the machine's noise falls on all of them alike, and every version's package is compiled to
bytecode first, so that the lazy imports inside the call cost what they cost in an installed package.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_proc import Sampler

REPO = Path(__file__).resolve().parents[1]
RANK_SCRIPT = Path(__file__).with_name("_bench_apply_rank.py")
VARIANTS = ("file", "folder", "broadcast", "fsdp2")


def _extract(rev: str, into: Path) -> Path:
    """The ``dist_resume`` package of ``rev`` under ``into`` (``git archive``), for PYTHONPATH."""
    blob = subprocess.run(["git", "-C", str(REPO), "archive", rev, "dist_resume"], capture_output=True, check=True)
    with tarfile.open(fileobj=BytesIO(blob.stdout)) as tar:
        tar.extractall(into, filter="data")
    return into


def _has_fsdp2_resume(root: Path) -> bool:
    return (root / "dist_resume" / "_checkpoint" / "sharded_restore.py").exists()


def _launch(
    root: Path, action: str, variant: str, folder: Path, ranks: int, mib: int, sampler: Sampler | None
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(RANK_SCRIPT),
                    action,
                    variant,
                    str(folder),
                    str(store),
                    str(r),
                    str(ranks),
                    str(mib),
                ],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
            for r in range(ranks)
        ]
        if sampler is not None:
            for p in procs:
                sampler.add(p.pid)
        outs = []
        try:
            for r, p in enumerate(procs):
                out, err = p.communicate(timeout=600)
                if p.returncode != 0:
                    raise RuntimeError(f"{action} {variant} rank {r} failed ({p.returncode}):\n{err[-3000:]}")
                outs.append((p.pid, out))
        finally:
            for q in procs:
                if q.poll() is None:
                    os.killpg(q.pid, 9)
    if action == "save":
        return []
    results = []
    for pid, out in outs:
        report = json.loads(out.strip().splitlines()[-1])
        assert sampler is not None
        peak = sampler.peak(pid, *report["window"])
        report["growth_mib"] = (peak["anon_kib"] - report["before_kib"]) / 1024
        report["samples"] = peak["samples"]
        results.append(report)
    return results


def _summary(runs: list[list[dict[str, Any]]], ranks: int) -> dict[str, Any]:
    return {
        "seconds": statistics.median(max(r["seconds"] for r in run) for run in runs),
        "growth_mib": [statistics.median(run[rank]["growth_mib"] for run in runs) for rank in range(ranks)],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--versions", default="0.2=7b8b64e,0.3.0=856d0ab", help="label=git revision, comma-separated")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    versions = [tuple(v.split("=", 1)) for v in args.versions.split(",") if v] + [("now", "")]
    variants = [v for v in args.variants.split(",") if v]
    figures: dict[str, dict[str, Any]] = {}
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        roots: dict[str, Path] = {}
        for label, rev in versions:
            roots[label] = REPO if not rev else _extract(rev, Path(tmp) / f"src-{label}")
            # bytecode first: the call is timed as in an installed package (this machine may not write __pycache__)
            compileall.compile_dir(roots[label] / "dist_resume", quiet=1)
            _launch(roots[label], "save", "file", Path(tmp) / f"ckpt-{label}", args.ranks, args.mib, None)
        runs: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
        for _ in range(args.repeat):  # versions interleaved, so that the machine's noise falls on all of them alike
            for variant in variants:
                for label, _rev in versions:
                    if variant == "fsdp2" and not _has_fsdp2_resume(roots[label]):
                        continue
                    with Sampler() as sampler:
                        run = _launch(
                            roots[label], "resume", variant, Path(tmp) / f"ckpt-{label}", args.ranks, args.mib, sampler
                        )
                    runs.setdefault((label, variant), []).append(run)
        for (label, variant), measured in runs.items():
            figures.setdefault(label, {})[variant] = _summary(measured, args.ranks)
        for label, _rev in versions:
            figures.setdefault(label, {})
    print(
        f"{args.ranks} ranks (gloo), a {args.mib} MiB float32 model + warm AdamW state resumed from its own checkpoint; "
        f"median of {args.repeat}; time of the call, peak RssAnon growth per rank during it"
    )
    head = f"{'variant':<10}" + "".join(f" | {label + (f' ({rev})' if rev else ''):<30}" for label, rev in versions)
    print(head + f" | time vs {versions[0][0]}")
    for variant in variants:
        cells, ratios = [], []
        for label, _ in versions:
            m = figures[label].get(variant)
            if m is None:
                cells.append(f"{'n/a':<30}")
                continue
            growth = "/".join(f"{g:+.0f}" for g in m["growth_mib"])
            cells.append(f"{m['seconds']:5.2f} s, {growth} MiB".ljust(30))
            first = figures[versions[0][0]].get(variant)
            if first is not None:
                ratios.append(f"{label} {m['seconds'] / first['seconds']:.2f}x")
        print(f"{variant:<10}" + "".join(f" | {c}" for c in cells) + " | " + ", ".join(ratios))
    print(f"({time.monotonic() - started:.0f} s in all)")
    if args.json:
        args.json.write_text(json.dumps({"mib": args.mib, "ranks": args.ranks, "figures": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
