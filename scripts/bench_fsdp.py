#!/usr/bin/env python
"""A full checkpoint into an FSDP2 model and back: peak anonymous memory per rank and wall time, side by side.

The checkpoint is ``--layers`` x Linear(``--width``, ``--width``) with AdamW after one step, saved by one
plain process (the defaults, 8 x 4096, make 1.5 GiB). At each ``--ranks`` (gloo, a CPU mesh, fresh spawned
processes, one torch thread each) it is loaded into a model sharded with fully_shard (per layer, then
the root):

- ``dsd_broadcast``: torch's DSD ``set_model_state_dict``/``set_optimizer_state_dict`` with
  ``full_state_dict=True, broadcast_from_rank0=True``, rank 0 memory-mapping the file;
- ``dsd_each``: DSD with ``full_state_dict=True``, every rank memory-mapping the file;
- ``ours_each``: every rank maps the file and copies its boxes into its shards (``load_full_model_state``,
  ``load_full_optimizer_state``);
- ``ours_scatter``: rank 0 alone maps the file (a node-local disk) and sends each rank its boxes, which land
  in the shards (``scatter_full_into``);

with the optimizer fresh (its state is built: two thirds of the shard are new memory whoever loads) and warm
(the state exists: what the load itself costs). Then saved back to one file: ``dsd_full``
(``get_*_state_dict(full_state_dict=True, cpu_offload=True)`` + ``torch.save`` on rank 0), ``full_tensor``
(``DTensor.full_tensor()`` per tensor into a streaming writer), ``ours`` (``save_full_state``).

Growth is the peak of RssAnon (sampled by the parent from ``/proc/<pid>/status`` every 2 ms) over the rank's
own RssAnon when the step began, as a multiple of its shard (its parameters and their two Adam moments);
file-backed pages (the mapped checkpoint in the page cache) are not anonymous memory and not counted. Each
run checks its result against the file. Timing is wall time of the step, as a multiple of the first mode's.

    python scripts/bench_fsdp.py --width 1024          # 96 MiB: a smoke run
    python scripts/bench_fsdp.py                       # 1.5 GiB at 2 and 4 ranks (~4 GiB RAM, ~3 GiB disk)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _bench_* helpers, here and in spawned children

from _bench_fsdp import LOADS, SAVES, load_rank, make_checkpoint, save_rank
from _bench_proc import launch

MIB = 2**20


def _measure(body: Any, world_size: int, args: tuple[Any, ...]) -> dict[str, Any]:
    run = launch(body, world_size, args, timeout=900)
    ranks = []
    for rank, res in enumerate(run.results):
        peak = run.peak(rank, res["window"])
        growth = max(0, peak["anon_kib"] - res["anon0_kib"]) * 1024
        ranks.append(
            {"growth": growth, "ratio": growth / res["shard"], "file_kib": peak["file_kib"], "samples": peak["samples"]}
        )
        if not res["ok"]:
            raise SystemExit(f"{body.__name__}{args[2:]}: rank {rank}'s result differs from the file")
    start = min(r["window"][0] for r in run.results)
    end = max(r["window"][1] for r in run.results)
    return {"wall_s": end - start, "ranks": ranks, "shard": run.results[0]["shard"]}


def _row(name: str, m: dict[str, Any], base: float) -> str:
    zero, rest = m["ranks"][0], m["ranks"][1:]
    worst = max(rest, key=lambda r: r["growth"])
    return (
        f"  {name:<24} {zero['growth'] / MIB:9.1f} MiB {zero['ratio']:7.3f}x  {worst['growth'] / MIB:9.1f} MiB "
        f"{worst['ratio']:7.3f}x  {m['wall_s']:7.2f} s {m['wall_s'] / base:6.2f}x"
    )


def _table(title: str, runs: dict[str, dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"  {'':<24} {'rank 0 growth':>22}  {'worst other rank':>22}  {'wall time':>16}")
    base = next(iter(runs.values()))["wall_s"]
    for how, m in runs.items():
        print(_row(how, m, base))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS)
    parser.add_argument("--saves", nargs="+", default=list(SAVES), choices=[*SAVES, "none"])
    parser.add_argument("--warm", choices=["both", "warm", "fresh"], default="both")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="bench_fsdp."))
    results: dict[str, Any] = {"width": args.width, "layers": args.layers}
    try:
        ckpt = folder / "plain.pt"
        size = launch(make_checkpoint, 1, (str(ckpt), args.width, args.layers), timeout=900).results[0]
        results["file_bytes"] = size
        print(f"checkpoint: {args.layers} x Linear({args.width}, {args.width}) + AdamW, {size / MIB:.0f} MiB")
        warmth = {"both": (False, True), "warm": (True,), "fresh": (False,)}[args.warm]
        for world_size in args.ranks:
            for warm in warmth:
                label = "warm optimizer (state exists)" if warm else "fresh optimizer (state built)"
                runs = {
                    how: _measure(load_rank, world_size, (str(ckpt), args.width, args.layers, how, warm))
                    for how in args.loads
                }
                shard = next(iter(runs.values()))["shard"]
                _table(f"load at {world_size} ranks, {label}; shard per rank {shard / MIB:.0f} MiB", runs)
                results[f"load_{world_size}_{'warm' if warm else 'fresh'}"] = runs
            saves = [s for s in args.saves if s != "none"]
            if saves:
                out = folder / "full.pt"
                runs = {how: _measure(save_rank, world_size, (str(out), args.width, args.layers, how)) for how in saves}
                _table(f"save to one file at {world_size} ranks", runs)
                results[f"save_{world_size}"] = runs
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
