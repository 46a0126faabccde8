"""What a fuzz run found: the table of outcomes per read path; each bad outcome's signature (path, outcome, type,
raising function, message shape), a reproducer minimised by reverting changed bytes while the signature holds, and
the reproducers written with their notes into ``DIR/repro/``."""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from _fuzz_pool import BAD, Case, Pool


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


def write_reproducers(
    pool: Pool, results: list[tuple[Case, dict[str, Any]]], out: Path, seed: int, *, minimised: bool = True
) -> list[dict[str, Any]]:
    """One reproducer per distinct bad outcome of ``results`` (minimised on ``pool`` unless ``minimised`` is False)
    in ``out/repro/``, the file and a JSON note each; returns the notes."""
    found: dict[tuple[str, ...], tuple[Case, dict[str, Any], int]] = {}
    for case, result in results:
        if result["outcome"] in BAD:
            sig = signature(case, result)
            seen = found.get(sig)
            found[sig] = (seen[0], seen[1], seen[2] + 1) if seen else (case, result, 1)
    repro = out / "repro"
    notes = []
    for n, (sig, (case, result, count)) in enumerate(sorted(found.items())):
        data, changed = minimise(pool, case, sig) if minimised else (case.data, -1)
        repro.mkdir(exist_ok=True)
        name = f"{n:03d}-{re.sub(r'[^a-z0-9]+', '_', case.path)}-{result['outcome']}"
        suffix = case.source_file.suffix or ".bin"
        if not case.deleted:
            (repro / f"{name}{suffix}").write_bytes(data)
        note = {
            "seed": seed,
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
    return notes
