"""Mutation fuzzing of every read path: each bad input must end in success or a DistResumeError.

Usage::

    python scripts/fuzz.py --cases 1000 --seed 0 [--out DIR] [--jobs J] [--timeout S]
    python scripts/fuzz.py --replay tests/fuzz_cases/manifest.json     # the kept reproducers
    python scripts/fuzz.py --check-corpus                               # every unmutated item succeeds
    python scripts/fuzz.py --ci --cases 150 --seed 1 --replay tests/fuzz_cases/manifest.json --out DIR
                                                                        # the three on one corpus (tests/test_fuzz.py)

A case is one mutated corpus file (or a checkpoint folder one of whose files is mutated or deleted) run
through one read path (``_fuzz_worker.PATHS`` and the others there: the library's readers, every resume, the CLI's
inspect, verify, convert to every format and list) in a long-lived worker process. Outcomes:
``success``, ``refused`` (a DistResumeError subclass; for the CLI exit status 2/3), ``escape``
(any other exception; for the CLI the internal-error exit status 4), ``crash`` (the worker died
by a signal), ``hang`` (over the per-case time limit: the worker is killed and replaced),
``memory`` (peak anonymous memory over 2x the file + 256 MiB, or an allocation failure),
``half-restore`` (a resume that raised but left a live object, or the RNG streams, unlike before it) and
``late`` (a resume refused by a part's own load, a RestoreError, after its plan had passed the file: validation
must refuse first). Half of the torch files' mutations (``--structural``) are structure-aware (a key renamed,
dropped or retyped inside the pickled object, a tensor replaced by another type, a tensor's shape or dtype
changed, an entry nested or flattened; re-saved with torch.save), the rest flip, cut and splice bytes. Each
distinct bad outcome (by path, type, raising function and message shape) gets a minimised reproducer in
``DIR/repro/`` with a JSON note (seed, case id, traceback). Exit status 1 when any bad outcome was found.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _fuzz_corpus import build_corpus, members
from _fuzz_findings import report, write_reproducers
from _fuzz_mutate import STRUCTURAL_SHARE, mutate_file
from _fuzz_pool import BAD, Case, Pool, run_all
from _fuzz_worker import paths_for


def make_cases(
    corpus: dict[str, Path],
    n: int,
    seed: int,
    *,
    only: frozenset[str] = frozenset(),
    share: float = STRUCTURAL_SHARE,
) -> list[Case]:
    """``n`` seeded cases over the corpus items (those named in ``only``, where given; else every item) and their
    paths (those named in ``only`` too); ``share`` of the torch files' mutations are structure-aware."""
    names = sorted(name for name in corpus if name in only or not only & set(corpus))
    files = {
        name: [corpus[name] / m for m in members(corpus[name])] if corpus[name].is_dir() else [corpus[name]]
        for name in names
    }  # fmt: skip
    every = [f for fs in files.values() for f in fs]
    data = {f: f.read_bytes() for f in every}
    loaded: dict[bytes, Any] = {}  # each torch file's object, for the structure-aware mutations
    cases = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        name = rng.choice(names)
        source = rng.choice(files[name])
        member = str(source.relative_to(corpus[name])) if corpus[name].is_dir() else ""
        other = data[rng.choice(every)]
        paths = paths_for(name, corpus[name])
        path = rng.choice([p for p in paths if p in only] or paths)
        if member and name != "manager" and rng.random() < 0.08:
            mutation, mutated, deleted = "delete", b"", True
        else:
            (mutation, mutated), deleted = mutate_file(data[source], source, other, rng, loaded, share), False
        cases.append(Case(i, name, mutation, path, mutated, corpus[name], member, deleted))
    return cases


def replay_cases(manifest: Path, corpus: dict[str, Path]) -> tuple[list[dict[str, Any]], list[Case]]:
    """The kept reproducers of ``manifest.json`` (the files next to it) as cases; case ``i`` is entry ``i``."""
    entries = json.loads(manifest.read_text())
    cases = [
        Case(
            i,
            e["corpus"],
            e["mutation"],
            e["path"],
            (manifest.parent / e["file"]).read_bytes() if e.get("file") else b"",
            corpus[e["corpus"]],
            e.get("member", "") or (members(corpus[e["corpus"]])[0] if corpus[e["corpus"]].is_dir() else ""),
            bool(e.get("deleted", False)),
        )
        for i, e in enumerate(entries)
    ]
    return entries, cases


def replay_rows(entries: list[dict[str, Any]], results: list[tuple[Case, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each manifest entry with its outcome now (``now``, ``now_type``, ``now_message``), printed one per line."""
    rows = [
        {**entries[c.id], "now": r["outcome"], "now_type": r.get("type", ""), "now_message": r.get("message", "")}
        for c, r in results
    ]
    for row in rows:
        print(f"{row['now']:>8}  {row['file']}  {row['path']}  {row['now_type']} {row['now_message'][:100]}")
    return rows


def corpus_cases(corpus: dict[str, Path]) -> list[Case]:
    """Every unmutated corpus item on each of its paths."""
    cases: list[Case] = []
    for name, source in sorted(corpus.items()):
        member = members(source)[0] if source.is_dir() else ""
        data = (source / member if member else source).read_bytes()
        for path in paths_for(name, source):
            cases.append(Case(len(cases), name, "none", path, data, source, member))
    return cases


def corpus_failures(results: list[tuple[Case, dict[str, Any]]]) -> list[str]:
    """The unmutated cases that did not succeed, one line each (printed)."""
    # inspect_checkpoint describes dist_resume's own files and the foreign sources; a hand-made torch file has no
    # metadata for it (NotACheckpointError, by contract); `dist-resume inspect` describes every item
    bad = [
        f"{c.corpus:>16}  {c.path:<32} {r['outcome']}: {r.get('type', '')} {r.get('message', '')}"
        for c, r in results
        if r["outcome"] != "success" and not (r["outcome"] == "refused" and c.path == "inspect_checkpoint")
    ]
    for line in bad:
        print(line)
    print(f"{len(results)} unmutated cases, {len(bad)} not successful")
    return bad


def _on_a_corpus(run: Any) -> Any:
    """``run(corpus, work)`` on a freshly built corpus in a temporary folder, removed afterwards."""
    work = Path(tempfile.mkdtemp(prefix="fuzz_work_"))
    try:
        return run(build_corpus(work / "corpus"), work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def replay(manifest: Path, jobs: int, timeout: float, out: Path | None) -> int:
    """Run kept reproducers (``manifest.json`` next to them) through their paths; 1 if any is still bad."""

    def run(corpus: dict[str, Path], work: Path) -> list[dict[str, Any]]:
        entries, cases = replay_cases(manifest, corpus)
        return replay_rows(entries, run_all(cases, jobs, timeout, work / "scratch"))

    rows = _on_a_corpus(run)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(rows, indent=1))
    return 1 if any(row["now"] in BAD for row in rows) else 0


def check_corpus(jobs: int, timeout: float) -> int:
    """Run every unmutated corpus item through each of its paths: each must succeed (1 if any does not)."""
    bad = _on_a_corpus(
        lambda corpus, work: corpus_failures(run_all(corpus_cases(corpus), jobs, timeout, work / "scratch"))
    )
    return 1 if bad else 0


def ci(cases: int, seed: int, manifest: Path, jobs: int, timeout: float, out: Path) -> int:
    """The CI run, on one corpus and one worker pool: the unmutated corpus (``--check-corpus``), the kept
    reproducers (``--replay``) and ``cases`` seeded mutations. ``out/ci.json`` holds the three results; 1 if any
    part failed."""

    def run(corpus: dict[str, Path], work: Path) -> dict[str, Any]:
        entries, kept = replay_cases(manifest, corpus)
        parts = {"corpus": corpus_cases(corpus), "replay": kept, "fuzz": make_cases(corpus, cases, seed)}
        flat = [(part, c) for part, cs in parts.items() for c in cs]
        numbered = [replace(c, id=k) for k, (_, c) in enumerate(flat)]  # one id space in the pool
        results = run_all(numbered, jobs, timeout, work / "scratch")
        split: dict[str, list[tuple[Case, dict[str, Any]]]] = defaultdict(list)
        for case, result in results:
            part, original = flat[case.id]
            split[part].append((original, result))
        outcomes = Counter(r["outcome"] for _, r in split["fuzz"])
        print(report(split["fuzz"]))
        return {
            "corpus": {"cases": len(split["corpus"]), "not_successful": corpus_failures(split["corpus"])},
            "replay": replay_rows(entries, split["replay"]),
            "fuzz": {"cases": len(split["fuzz"]), "seed": seed, "outcomes": dict(outcomes)},
        }

    start = time.monotonic()
    result = _on_a_corpus(run)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ci.json").write_text(json.dumps(result, indent=1))
    bad = (
        result["corpus"]["not_successful"]
        or any(row["now"] in BAD for row in result["replay"])
        or any(o in BAD for o in result["fuzz"]["outcomes"])
    )
    print(
        f"ci: {len(result['replay'])} reproducers, {cases} mutations (seed {seed}) in {time.monotonic() - start:.1f}s"
    )
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="reports and reproducers (default: a temp folder)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds one case may take")
    parser.add_argument("--no-minimise", action="store_true")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated corpus items and/or read paths to fuzz (default: every item on every path)",
    )
    parser.add_argument(
        "--structural", type=float, default=STRUCTURAL_SHARE, help="the share of structure-aware torch-file mutations"
    )
    parser.add_argument("--replay", type=Path, default=None, help="run the cases of a manifest.json (tests/fuzz_cases)")
    parser.add_argument("--check-corpus", action="store_true", help="every unmutated corpus item must succeed")
    parser.add_argument(
        "--ci", action="store_true", help="--check-corpus, --replay MANIFEST and --cases N on one corpus (ci.json)"
    )
    args = parser.parse_args(argv)
    only = frozenset(filter(None, (s.strip() for s in args.only.split(","))))
    if args.ci:
        if args.replay is None or args.out is None:
            parser.error("--ci needs --replay MANIFEST and --out DIR")
        return ci(args.cases, args.seed, args.replay, args.jobs, args.timeout, args.out)
    if args.check_corpus:
        return check_corpus(args.jobs, args.timeout)
    if args.replay is not None:
        return replay(args.replay, args.jobs, args.timeout, args.out)
    start = time.monotonic()
    out = args.out or Path(tempfile.mkdtemp(prefix="dist_resume_fuzz_"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="fuzz_work_"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        corpus = build_corpus(work / "corpus")
        cases = make_cases(corpus, args.cases, args.seed, only=only, share=args.structural)
        pool = Pool(args.jobs, args.timeout, work / "scratch")
        try:
            results = sorted(pool.run(cases), key=lambda cr: cr[0].id)
            ran = time.monotonic() - start
            notes = write_reproducers(pool, results, out, args.seed, minimised=not args.no_minimise)
        finally:
            pool.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = report(results)
    summary = {
        "cases": len(results),
        "seed": args.seed,
        "seconds": round(ran, 1),
        "workers_started": pool.started,
        "outcomes": dict(Counter(r["outcome"] for _, r in results)),
        "distinct_bad": len(notes),
    }
    (out / "report.json").write_text(json.dumps({"summary": summary, "table": table, "bad": notes}, indent=1))
    print(table)
    print(
        f"\n{len(results)} cases (seed {args.seed}) in {ran:.1f}s with {args.jobs} workers "
        f"({pool.started} started); distinct bad outcomes (escape, crash, hang, memory, half-restore, late): {len(notes)}; report in {out}"
    )
    for note in notes:
        print(
            f"  [{note['outcome']}] {note['path']}: {note.get('type')}: {note.get('message', '')[:120]} "
            f"at {note.get('ours') or note.get('where')} x{note['count']} -> repro/{note['file']}"
        )
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
