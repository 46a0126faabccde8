"""A seeded slice of the coverage-guided fuzzer (scripts/fuzz_atheris.py): libFuzzer over the bytes of valid
dist_resume files and their side files, through the public readers; nothing but success or a DistResumeError."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "scripts" / "fuzz_atheris.py"

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("atheris") is None,
    reason="atheris is not installed (the test extra installs it on Linux: pip install 'dist-resume[test]')",
)


def _fuzz(tmp_path: Path, *args: str, timeout: float) -> tuple[subprocess.CompletedProcess[str], str]:
    artifacts = tmp_path / "artifacts"
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--artifacts", str(artifacts), "--corpus", str(tmp_path / "corpus"), *args],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    output = "\n".join(line for line in (out.stdout + out.stderr).splitlines() if "Instrumenting" not in line)
    crashes = sorted(p.name for p in artifacts.iterdir()) if artifacts.exists() else []
    assert not crashes, (
        f"inputs that escaped (replay: python scripts/fuzz_atheris.py FILE): {crashes}\n{output[-6000:]}"
    )
    return out, output


def _coverage(output: str) -> int:
    return max(int(n) for n in re.findall(r"\bcov: (\d+)", output))


@pytest.mark.slow
def test_a_seeded_slice_finds_nothing_and_grows_coverage(tmp_path: Path) -> None:  # 10-20 s
    out, output = _fuzz(tmp_path, "-runs=300", "-seed=1", timeout=120)
    assert out.returncode == 0, output[-6000:]
    assert "Done 300 runs" in output, output[-3000:]
    # the seeds pass every reader (the script exits 2 otherwise) and the mutations reach past them
    seeds = re.search(r"INITED cov: (\d+)", output)
    assert seeds is not None and _coverage(output) > int(seeds.group(1)) > 1000, output[-3000:]
    assert len(list((tmp_path / "corpus").iterdir())) > 8  # libFuzzer kept inputs that reached new code


@pytest.mark.slow
def test_a_ten_minute_run_finds_nothing(tmp_path: Path) -> None:  # 10 min and start-up
    out, output = _fuzz(tmp_path, "-max_total_time=600", "-seed=7", "-print_final_stats=1", timeout=900)
    assert out.returncode == 0, output[-6000:]
    assert "stat::number_of_executed_units" in output, output[-3000:]
