"""A seeded slice of the mutation fuzzer (scripts/fuzz.py) and the kept reproducers: no read path may escape,
crash, hang or allocate past its bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CASES = 1000  # about 25 s with 2 workers on 2 cores (scripts/fuzz.py reports the time)


def test_a_seeded_fuzz_slice_has_no_escape_crash_or_hang(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "fuzz.py"),
            "--cases",
            str(CASES),
            "--seed",
            "0",
            "--out",
            str(tmp_path),
            "--jobs",
            "2",
            "--no-minimise",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    report = json.loads((tmp_path / "report.json").read_text())
    summary = report["summary"]
    assert summary["cases"] == CASES, out.stdout + out.stderr
    assert summary["outcomes"].get("success", 0) > 0 and summary["outcomes"].get("refused", 0) > 0, summary
    bad = {k: v for k, v in summary["outcomes"].items() if k in ("escape", "crash", "hang", "memory")}
    assert not bad, out.stdout
    assert out.returncode == 0, out.stdout + out.stderr


def test_kept_fuzz_reproducers_are_refused_cleanly(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    manifest = REPO_ROOT / "tests" / "fuzz_cases" / "manifest.json"
    out = subprocess.run(
        [
            sys.executable,
            str(REPO_ROOT / "scripts" / "fuzz.py"),
            "--replay",
            str(manifest),
            "--jobs",
            "2",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
    )
    rows = json.loads((tmp_path / "replay.json").read_text())
    assert len(rows) == len(json.loads(manifest.read_text())), out.stdout + out.stderr
    still_bad = [
        f"{r['file']} ({r['path']}): {r['now']} {r['now_type']}" for r in rows if r["now"] not in ("success", "refused")
    ]
    assert not still_bad, "\n".join(still_bad)
