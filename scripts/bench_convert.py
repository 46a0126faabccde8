#!/usr/bin/env python
"""Benchmark ``dist-resume convert`` against ``cp`` and against the naive load + rename + save.

For two checkpoint sizes (``--size-gib`` and a quarter of it) this builds a DDP-keyed
checkpoint of many tensors of mixed sizes plus Adam state, then measures, each in its own
process and with the page cache warm:

* ``cp SRC DST`` and ``cp`` followed by an fsync of DST (``convert`` fsyncs: that is the fair twin);
* ``python -m dist_resume convert SRC DST --to single`` (process wall time, and the conversion's
  own time as the command reports it, without interpreter start-up and imports);
* the naive ``sd = torch.load(SRC); rename keys; torch.save(sd, DST)``, with and without ``mmap=True``;
* the import floor: a process that only imports torch and ``dist_resume.cli`` (which alone no longer imports
  torch; torch's own libraries are mapped copy-on-write, so importing torch alone costs ~150 MiB of anonymous
  memory).

Peak anonymous memory is the highest ``RssAnon`` the parent sees polling ``/proc/<pid>/status``
every 2 ms (VmHWM would count the page cache of memory-mapped files too). Prints a table per size
and one JSON document; ``--json-out`` also writes it to a file. Files are deleted unless ``--keep``.

    python scripts/bench_convert.py                # ~2 GiB and ~0.5 GiB, needs ~6 GiB of disk
    python scripts/bench_convert.py --size-gib 0.2 # a quick run
    python scripts/bench_convert.py --formats --quick  # .pt <-> .safetensors and .pt -> DCP, 0.25 and 1 GiB

``--formats`` measures the format conversions instead, on a weights-only file (``--size-gib`` and a
quarter of it): ``convert --format safetensors`` (pt -> safetensors), ``convert --format pt`` of that
output (safetensors -> pt), both against ``cp`` + fsync (target <= 1.5x, peak RssAnon flat as the file
grows), and ``convert --format dcp`` (pt -> DCP, which loads the tensors). ``--quick`` is one run per
measurement at 0.25 and 1 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the _bench_convert_* helpers

from _bench_convert_formats import bench_formats, formats_table
from _bench_convert_harness import BUILD, SHAPES, fsync, measure, warm

NAIVE = r"""
import sys, torch
src, dst, mmap = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
ckpt = torch.load(src, weights_only=True, mmap=mmap)
ckpt["model"] = {k.removeprefix("module."): v for k, v in ckpt["model"].items()}
for g in ckpt["optimizer"]["param_groups"]:
    g["param_names"] = [n.removeprefix("module.") for n in g["param_names"]]
torch.save(ckpt, dst)
"""


def bench_size(folder: Path, size_bytes: int, repeat: int) -> dict[str, Any]:
    src, dst = folder / f"src_{size_bytes}.pt", folder / f"dst_{size_bytes}.pt"
    built = subprocess.run(
        [sys.executable, "-c", BUILD.format(shapes=SHAPES), str(src), str(size_bytes)],
        check=True,
        capture_output=True,
        text=True,
    )
    n_params = int(built.stdout.strip())
    py = sys.executable
    runs: dict[str, list[dict[str, Any]]] = {
        k: [] for k in ("cp", "cp+fsync", "convert", "naive", "naive_mmap", "import floor")
    }
    for _ in range(repeat):
        for name in runs:
            dst.unlink(missing_ok=True)
            os.sync()  # no dirty pages from the previous run throttle this one
            warm(src)
            if name in ("cp", "cp+fsync"):
                start = time.perf_counter()
                subprocess.run(["cp", str(src), str(dst)], check=True)
                if name == "cp+fsync":
                    fsync(dst)
                runs[name].append({"seconds": time.perf_counter() - start, "peak_rss_anon_mib": None})
            elif name == "convert":
                r = measure([py, "-m", "dist_resume", "convert", str(src), str(dst), "--to", "single", "--json"])
                r["in_process_seconds"] = json.loads(r.pop("stdout"))["seconds"]
                runs[name].append(r)
            elif name.startswith("naive"):
                r = measure([py, "-c", NAIVE, str(src), str(dst), "1" if name == "naive_mmap" else "0"])
                r.pop("stdout")
                runs[name].append(r)
            else:
                r = measure([py, "-c", "import torch, dist_resume.cli"])
                r.pop("stdout")
                runs[name].append(r)
    pickle_bytes = _pickle_bytes(src)
    file_bytes = src.stat().st_size
    src.unlink()
    dst.unlink(missing_ok=True)
    # per parameter: the weight, exp_avg, exp_avg_sq and a scalar step
    result: dict[str, Any] = {
        "file_bytes": file_bytes,
        "params": n_params,
        "tensors": 4 * n_params,
        "pickle_bytes": pickle_bytes,
    }
    for name, rs in runs.items():
        entry = {"seconds": statistics.median(r["seconds"] for r in rs), "min_seconds": min(r["seconds"] for r in rs)}
        if rs[0]["peak_rss_anon_mib"] is not None:
            entry["peak_rss_anon_mib"] = max(r["peak_rss_anon_mib"] for r in rs)
        if "in_process_seconds" in rs[0]:
            entry["in_process_seconds"] = statistics.median(r["in_process_seconds"] for r in rs)
            entry["min_in_process_seconds"] = min(r["in_process_seconds"] for r in rs)
        result[name] = entry
    conv, cp, cps = result["convert"], result["cp"]["seconds"], result["cp+fsync"]["seconds"]
    floor = result["import floor"]["peak_rss_anon_mib"]
    best_cp, best_cps = result["cp"]["min_seconds"], result["cp+fsync"]["min_seconds"]
    result["ratios"] = {  # medians, and best runs (least disturbed by other load on the machine)
        "convert_process_vs_cp": conv["seconds"] / cp,
        "convert_in_process_vs_cp": conv["in_process_seconds"] / cp,
        "convert_in_process_vs_cp_fsync": conv["in_process_seconds"] / cps,
        "best_convert_in_process_vs_cp": conv["min_in_process_seconds"] / best_cp,
        "best_convert_in_process_vs_cp_fsync": conv["min_in_process_seconds"] / best_cps,
    }
    result["convert_anon_above_import_floor_mib"] = conv["peak_rss_anon_mib"] - floor
    result["target_anon_mib"] = 64 + pickle_bytes / 2**20
    return result


def _pickle_bytes(path: Path) -> int:
    import zipfile

    with zipfile.ZipFile(path) as zf:
        return next(i.file_size for i in zf.infolist() if i.filename.endswith("/data.pkl"))


def table(results: list[dict[str, Any]]) -> str:
    rows = [f"{'size':>9} {'what':<15} {'median s':>8} {'best s':>7} {'peak RssAnon MiB':>17}"]
    for r in results:
        size = f"{r['file_bytes'] / 2**30:.2f} GiB"
        for name in ("cp", "cp+fsync", "convert", "naive", "naive_mmap", "import floor"):
            e = r[name]
            anon = f"{e['peak_rss_anon_mib']:.0f}" if "peak_rss_anon_mib" in e else "-"
            rows.append(f"{size:>9} {name:<15} {e['seconds']:8.2f} {e['min_seconds']:7.2f} {anon:>17}")
            if name == "convert":
                rows.append(
                    f"{'':>9} {'  (in process)':<15} {e['in_process_seconds']:8.2f} "
                    f"{e['min_in_process_seconds']:7.2f} {'':>17}"
                )
        q = r["ratios"]
        rows.append(
            f"{'':>9} convert/cp (median): process {q['convert_process_vs_cp']:.2f}x, in process "
            f"{q['convert_in_process_vs_cp']:.2f}x, vs cp+fsync {q['convert_in_process_vs_cp_fsync']:.2f}x; "
            f"best runs: {q['best_convert_in_process_vs_cp']:.2f}x, vs cp+fsync "
            f"{q['best_convert_in_process_vs_cp_fsync']:.2f}x"
        )
        rows.append(
            f"{'':>9} "
            f"convert anon above import floor {r['convert_anon_above_import_floor_mib']:.0f} MiB "
            f"(target <= {r['target_anon_mib']:.0f} MiB); {r['tensors']} tensors, data.pkl "
            f"{r['pickle_bytes'] / 2**10:.0f} KiB"
        )
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="the larger checkpoint (the other is 1/4 of it)")
    parser.add_argument("--repeat", type=int, default=3, help="runs per measurement (median time, max memory)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temp folder)")
    parser.add_argument("--json-out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the folder (files are always deleted)")
    parser.add_argument("--formats", action="store_true", help="measure pt <-> safetensors and pt -> DCP instead")
    parser.add_argument("--quick", action="store_true", help="one run each, 0.25 and 1 GiB")
    args = parser.parse_args()
    if args.quick:
        args.size_gib, args.repeat = 1.0, 1
    folder = Path(tempfile.mkdtemp(prefix="bench_convert.", dir=args.dir))
    try:
        sizes = [int(args.size_gib * 2**30 / 4), int(args.size_gib * 2**30)]
        bench = bench_formats if args.formats else bench_size
        results = [bench(folder, size, args.repeat) for size in sizes]
    finally:
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
    doc = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}, "results": results}
    print(formats_table(results) if args.formats else table(results))
    print(json.dumps(doc, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
