"""Mutation fuzzing of every read path: each bad input must end in success or a DistResumeError.

Usage::

    python scripts/fuzz.py --cases 1000 --seed 0 [--out DIR] [--jobs J] [--timeout S]
    python scripts/fuzz.py --replay tests/fuzz_cases/manifest.json     # the kept reproducers
    python scripts/fuzz.py --check-corpus                               # every unmutated item succeeds
    python scripts/fuzz.py --ci --cases 150 --seed 1 --replay tests/fuzz_cases/manifest.json --out DIR
                                                                        # the three on one corpus (tests/test_fuzz.py)

A case is one mutated corpus file (or a checkpoint folder whose newest file is mutated) run
through one read path (the library's and the CLI's) in a long-lived worker process. Outcomes:
``success``, ``refused`` (a DistResumeError subclass; for the CLI exit status 2/3), ``escape``
(any other exception; for the CLI the internal-error exit status 4), ``crash`` (the worker died
by a signal), ``hang`` (over the per-case time limit: the worker is killed and replaced) and
``memory`` (peak anonymous memory over 2x the file + 256 MiB, or an allocation failure) and
``half-restore`` (a resume that raised but left a live object, or the RNG streams, unlike before it).
On the paths that restore (``RESTORE_PATHS``), a share of the torch files' mutations is structure-aware (a key renamed, dropped or retyped inside
the pickled object, a tensor's shape or dtype changed, an entry nested or flattened; re-saved with
torch.save), the rest flips, cuts and splices bytes. Each distinct escape, crash, hang or half-restore (by path, type, raising function and message shape) gets a
minimised reproducer in ``DIR/repro/`` with a JSON note (seed, case id, traceback). Exit status
1 when any escape, crash, hang or memory case was found.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _fuzz_corpus import build_corpus, members, mutate_file
from _fuzz_worker import RESTORE_PATHS, paths_for, worker_main

BAD = ("escape", "crash", "hang", "memory", "half-restore")
MEMORY_SLACK_KIB = 256 << 10
_CTX = mp.get_context("forkserver")


@dataclass
class Case:
    id: int
    corpus: str
    mutation: str
    path: str
    data: bytes
    original: Path
    member: str = ""  # the file of a folder case that was mutated (or deleted)
    deleted: bool = False
    target: Path = field(default=Path())

    @property
    def source_file(self) -> Path:
        """The unmutated file this case's bytes came from."""
        return self.original / self.member if self.member else self.original


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    scratch: Path
    case: Case | None = None
    deadline: float = 0.0


class Pool:
    """Long-lived workers; a case over its time limit kills and replaces its worker."""

    def __init__(self, jobs: int, timeout: float, root: Path) -> None:
        self.timeout, self.root = timeout, root
        _CTX.set_forkserver_preload(["torch", "dist_resume", "_fuzz_corpus", "_fuzz_worker"])
        self.workers = [self._start(i) for i in range(jobs)]
        self.started = jobs

    def _start(self, slot: int) -> _Worker:
        parent, child = _CTX.Pipe()
        proc = _CTX.Process(target=worker_main, args=(child,), daemon=True)
        proc.start()
        child.close()
        if not parent.poll(120):
            raise RuntimeError("a fuzz worker did not start within 120 s")
        parent.recv()
        scratch = self.root / f"w{slot}-{proc.pid}"
        scratch.mkdir(parents=True)
        return _Worker(proc, parent, scratch)

    def _replace(self, i: int) -> None:
        old = self.workers[i]
        if old.proc.is_alive():
            old.proc.kill()
        old.proc.join(10)
        old.conn.close()
        shutil.rmtree(old.scratch, ignore_errors=True)
        self.workers[i] = self._start(i)
        self.started += 1

    def _submit(self, w: _Worker, case: Case) -> None:
        for old in w.scratch.iterdir():  # what the previous case wrote (outputs, folders)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
        if case.member:
            case.target = w.scratch / case.original.name
            shutil.copytree(case.original, case.target)
            if case.deleted:
                (case.target / case.member).unlink()
            else:
                (case.target / case.member).write_bytes(case.data)
        else:
            case.target = w.scratch / f"case{case.original.suffix}"
            case.target.write_bytes(case.data)
        w.case, w.deadline = case, time.monotonic() + self.timeout
        w.conn.send(
            {
                "id": case.id,
                "path": case.path,
                "target": str(case.target),
                "original": str(case.original),
                "scratch": str(w.scratch),
                "corpus": case.corpus,
            }
        )

    def run(self, cases: list[Case]) -> list[tuple[Case, dict[str, Any]]]:
        todo, done = list(reversed(cases)), []
        while todo or any(w.case for w in self.workers):
            for w in self.workers:
                if w.case is None and todo:
                    self._submit(w, todo.pop())
            busy = [w for w in self.workers if w.case is not None]
            now = time.monotonic()
            ready = wait(
                [w.conn for w in busy] + [w.proc.sentinel for w in busy],
                timeout=max(0.0, min(w.deadline for w in busy) - now),
            )
            for i, w in enumerate(self.workers):
                case = w.case
                if case is None:
                    continue
                result: dict[str, Any] | None = None
                if w.conn in ready:
                    try:
                        result = w.conn.recv()
                    except (EOFError, OSError):
                        result = None
                if result is None and (w.conn in ready or w.proc.sentinel in ready):
                    w.proc.join(5)
                    code = w.proc.exitcode
                    result = {"outcome": "crash", "type": f"signal {-code}" if code and code < 0 else f"exit {code}"}
                    self._replace(i)
                elif result is None and time.monotonic() >= w.deadline:
                    result = {"outcome": "hang", "type": f"over {self.timeout:g}s"}
                    self._replace(i)
                if result is None:
                    continue
                bound = 2 * len(case.data) // 1024 + MEMORY_SLACK_KIB
                if result["outcome"] not in BAD and result.get("peak_kib", 0) > bound:
                    result = {**result, "outcome": "memory", "type": f"peak {result['peak_kib'] >> 10} MiB"}
                self.workers[i].case = None
                done.append((case, result))
                if result["outcome"] == "memory" and self.workers[i].proc.is_alive():
                    self._replace(i)  # a fresh ru_maxrss for the next cases
        return done

    def close(self) -> None:
        for w in self.workers:
            w.conn.close()
            w.proc.join(5)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(5)


def make_cases(corpus: dict[str, Path], n: int, seed: int) -> list[Case]:
    files = {
        name: [p / m for m in members(p)] if p.is_dir() else [p] for name, p in sorted(corpus.items())
    }  # fmt: skip
    every = [f for fs in files.values() for f in fs]
    data = {f: f.read_bytes() for f in every}
    loaded: dict[bytes, Any] = {}  # each torch file's object, for the structure-aware mutations
    cases = []
    for i in range(n):
        rng = random.Random(f"{seed}:{i}")
        name = rng.choice(sorted(corpus))
        source = rng.choice(files[name])
        member = source.name if corpus[name].is_dir() else ""
        other = data[rng.choice(every)]
        path = rng.choice(paths_for(name, corpus[name]))
        structural = loaded if path in RESTORE_PATHS else None  # structure-aware edits where a resume applies
        if member and name != "manager" and rng.random() < 0.08:
            mutation, mutated, deleted = "delete", b"", True
        else:
            (mutation, mutated), deleted = mutate_file(data[source], source, other, rng, structural), False
        cases.append(Case(i, name, mutation, path, mutated, corpus[name], member, deleted))
    return cases


def signature(case: Case, result: dict[str, Any]) -> tuple[str, ...]:
    message = re.sub(r"'[^']*'|\"[^\"]*\"", "S", result.get("message", ""))
    message = re.sub(r"0x[0-9a-f]+|\d+", "N", message)[:80]
    where = result.get("ours") or result.get("where", "")
    where = re.sub(r":\d+$", "", where)
    return (case.path, result["outcome"], result.get("type", ""), where, message)


def minimise(pool: Pool, case: Case, sig: tuple[str, ...], budget: int = 48) -> tuple[bytes, int]:
    """Revert as many changed bytes as possible while the case keeps the same signature (ddmin-like)."""
    original = case.source_file.read_bytes()
    data = case.data
    if case.deleted or len(data) != len(original):
        return data, 0
    diff = [i for i in range(len(data)) if data[i] != original[i]]
    chunks = [diff]
    tries = 0
    while tries < budget and chunks:
        progress, next_chunks = False, []
        for chunk in chunks:
            if tries >= budget:
                next_chunks.append(chunk)
                continue
            candidate = bytearray(data)
            for pos in chunk:
                candidate[pos] = original[pos]
            if bytes(candidate) == original:
                next_chunks.append(chunk)
                continue
            trial = Case(case.id, case.corpus, case.mutation, case.path, bytes(candidate), case.original, case.member)
            tries += 1
            ((_, result),) = pool.run([trial])
            if result["outcome"] in BAD and signature(trial, result) == sig:
                data, progress = bytes(candidate), True
            else:
                next_chunks.append(chunk)
        remaining = [pos for c in next_chunks for pos in c if data[pos] != original[pos]]
        if len(remaining) <= 1 or (not progress and all(len(c) == 1 for c in next_chunks)):
            break
        half = max(1, len(next_chunks[0]) // 2) if next_chunks else 1
        chunks = [remaining[i : i + half] for i in range(0, len(remaining), half)]
    return data, sum(1 for i in range(len(data)) if data[i] != original[i])


def report(results: list[tuple[Case, dict[str, Any]]]) -> str:
    per_path: dict[str, Counter[str]] = defaultdict(Counter)
    for case, result in results:
        per_path[case.path][result["outcome"]] += 1
    outcomes = ["success", "refused", *BAD]
    width = max(len(p) for p in per_path) if per_path else 10
    lines = [f"{'path':<{width}}  " + "  ".join(f"{o:>8}" for o in outcomes)]
    total: Counter[str] = Counter()
    for path in sorted(per_path):
        total.update(per_path[path])
        lines.append(f"{path:<{width}}  " + "  ".join(f"{per_path[path][o]:>8}" for o in outcomes))
    lines.append(f"{'total':<{width}}  " + "  ".join(f"{total[o]:>8}" for o in outcomes))
    return "\n".join(lines)


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


def _run_all(cases: list[Case], jobs: int, timeout: float, scratch: Path) -> list[tuple[Case, dict[str, Any]]]:
    """Every case through a worker pool, results in case order."""
    pool = Pool(jobs, timeout, scratch)
    try:
        return sorted(pool.run(cases), key=lambda cr: cr[0].id)
    finally:
        pool.close()


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
        return replay_rows(entries, _run_all(cases, jobs, timeout, work / "scratch"))

    rows = _on_a_corpus(run)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "replay.json").write_text(json.dumps(rows, indent=1))
    return 1 if any(row["now"] in BAD for row in rows) else 0


def check_corpus(jobs: int, timeout: float) -> int:
    """Run every unmutated corpus item through each of its paths: each must succeed (1 if any does not)."""
    bad = _on_a_corpus(
        lambda corpus, work: corpus_failures(_run_all(corpus_cases(corpus), jobs, timeout, work / "scratch"))
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
        results = _run_all(numbered, jobs, timeout, work / "scratch")
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
    parser.add_argument("--replay", type=Path, default=None, help="run the cases of a manifest.json (tests/fuzz_cases)")
    parser.add_argument("--check-corpus", action="store_true", help="every unmutated corpus item must succeed")
    parser.add_argument(
        "--ci", action="store_true", help="--check-corpus, --replay MANIFEST and --cases N on one corpus (ci.json)"
    )
    args = parser.parse_args(argv)
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
        cases = make_cases(corpus, args.cases, args.seed)
        pool = Pool(args.jobs, args.timeout, work / "scratch")
        try:
            results = sorted(pool.run(cases), key=lambda cr: cr[0].id)
            ran = time.monotonic() - start
            found: dict[tuple[str, ...], tuple[Case, dict[str, Any], int]] = {}
            for case, result in results:
                if result["outcome"] in BAD:
                    sig = signature(case, result)
                    seen = found.get(sig)
                    found[sig] = (seen[0], seen[1], seen[2] + 1) if seen else (case, result, 1)
            repro = out / "repro"
            notes = []
            for n, (sig, (case, result, count)) in enumerate(sorted(found.items())):
                data, changed = (case.data, -1) if args.no_minimise else minimise(pool, case, sig)
                repro.mkdir(exist_ok=True)
                name = f"{n:03d}-{re.sub(r'[^a-z0-9]+', '_', case.path)}-{result['outcome']}"
                suffix = case.source_file.suffix or ".bin"
                if not case.deleted:
                    (repro / f"{name}{suffix}").write_bytes(data)
                note = {
                    "seed": args.seed,
                    "case": case.id,
                    "corpus": case.corpus,
                    "mutation": case.mutation,
                    "path": case.path,
                    "count": count,
                    "changed_bytes": changed,
                    "file": "" if case.deleted else f"{name}{suffix}",
                    "member": case.member,
                    "deleted": case.deleted,
                    **result,
                }
                (repro / f"{name}.note.json").write_text(json.dumps(note, indent=1))  # a member may be .json
                notes.append(note)
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
        f"({pool.started} started); distinct escapes/crashes/hangs/memory/half-restores: {len(notes)}; report in {out}"
    )
    for note in notes:
        print(
            f"  [{note['outcome']}] {note['path']}: {note.get('type')}: {note.get('message', '')[:120]} "
            f"at {note.get('ours') or note.get('where')} x{note['count']} -> repro/{note['file']}"
        )
    return 1 if notes else 0


if __name__ == "__main__":
    sys.exit(main())
