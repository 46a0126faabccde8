"""``scripts/bench_convert.py --formats``: the format conversions of a weights-only checkpoint (pt -> safetensors,
safetensors -> pt, pt -> DCP) against ``cp`` + fsync, each in its own process, and their table."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _bench_convert_harness import BUILD, SHAPES, fsync, measure, warm

__all__ = ["FORMATS", "bench_formats", "formats_table"]

FORMATS = ("cp+fsync", "pt->safetensors", "safetensors->pt", "pt->dcp", "import floor")


def bench_formats(folder: Path, size_bytes: int, repeat: int) -> dict[str, Any]:
    """Format conversions of a weights-only checkpoint of ``size_bytes``, each in its own process."""
    src, st, back, dcp = (folder / f"{n}_{size_bytes}" for n in ("src.pt", "m.safetensors", "back.pt", "dcp"))
    build = BUILD.replace('"optimizer": {{"state": state, "param_groups": groups}}, ', "").replace(
        "total += 3 * p.numel() * 4", "total += p.numel() * 4"
    )
    subprocess.run([sys.executable, "-c", build.format(shapes=SHAPES), str(src), str(size_bytes)], check=True)
    py = sys.executable
    cli = [py, "-m", "dist_resume", "convert", "--force", "--json"]
    commands = {
        "pt->safetensors": (src, [*cli, str(src), str(st), "--format", "safetensors"]),
        "safetensors->pt": (st, [*cli, str(st), str(back), "--format", "pt"]),
        "pt->dcp": (src, [*cli, str(src), str(dcp), "--format", "dcp"]),
        "import floor": (src, [py, "-c", "import torch, dist_resume.cli"]),
    }
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in FORMATS}
    for _ in range(repeat):
        for name in FORMATS:
            os.sync()
            if name == "cp+fsync":
                warm(src)
                start = time.perf_counter()
                subprocess.run(["cp", str(src), str(back)], check=True)
                fsync(back)
                runs[name].append({"seconds": time.perf_counter() - start, "peak_rss_anon_mib": None})
                back.unlink()
                continue
            warm_src, cmd = commands[name]
            if not warm_src.exists():
                continue
            warm(warm_src)
            r = measure(cmd)
            out = r.pop("stdout")
            if out.strip():
                r["in_process_seconds"] = json.loads(out)["seconds"]
            runs[name].append(r)
    result: dict[str, Any] = {"file_bytes": src.stat().st_size}
    for name, rs in runs.items():
        entry: dict[str, Any] = {"seconds": statistics.median(r["seconds"] for r in rs)}
        if rs[0]["peak_rss_anon_mib"] is not None:
            entry["peak_rss_anon_mib"] = max(r["peak_rss_anon_mib"] for r in rs)
        if "in_process_seconds" in rs[0]:
            entry["in_process_seconds"] = statistics.median(r["in_process_seconds"] for r in rs)
        result[name] = entry
    cps = result["cp+fsync"]["seconds"]
    floor = result["import floor"]["peak_rss_anon_mib"]
    result["ratios"] = {f"{name}_vs_cp_fsync": result[name]["in_process_seconds"] / cps for name in FORMATS[1:4]}
    result["anon_above_floor_mib"] = {name: result[name]["peak_rss_anon_mib"] - floor for name in FORMATS[1:4]}
    shutil.rmtree(dcp, ignore_errors=True)
    for path in (src, st, back):
        path.unlink(missing_ok=True)
    return result


def formats_table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'size':>9} {'what':<16} {'in-process s':>12} {'process s':>9} {'vs cp+fsync':>11} {'anon MiB':>9}"]
    for r in results:
        size = f"{r['file_bytes'] / 2**30:.2f} GiB"
        cps = r["cp+fsync"]["seconds"]
        for name in FORMATS:
            e = r[name]
            inproc = e.get("in_process_seconds", e["seconds"])
            ratio = f"{inproc / cps:.2f}x" if name != "import floor" else "-"
            anon = f"{e['peak_rss_anon_mib']:.0f}" if "peak_rss_anon_mib" in e else "-"
            rows.append(f"{size:>9} {name:<16} {inproc:12.2f} {e['seconds']:9.2f} {ratio:>11} {anon:>9}")
    return "\n".join(rows)
