"""What the toolkit finishes at interpreter exit (:mod:`dist_resume._core.exit`): background writes first, then the
releases, both while thread pools still take work (s3fs's requests need one: tests/test_s3.py sees the lease go)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent("""
    import concurrent.futures, sys, threading, time
    from dist_resume._core.exit import release_at_exit, wait_at_exit

    done = []

    def release():
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # what an fsspec store's request needs
            done.append(pool.submit(lambda: "released").result())
        print(done, flush=True)

    def write():
        time.sleep(0.5)
        done.append("written")

    release_at_exit(release)
    release_at_exit(release)  # registered once
    writer = threading.Thread(target=write)
    writer.start()
    wait_at_exit(writer)
    if sys.argv[1] == "raise":
        raise RuntimeError("the script failed")
""")


@pytest.mark.parametrize("how", ["end", "raise"])
def test_at_exit_writes_finish_then_releases_run_while_thread_pools_take_work(how: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, how], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.stdout == "['written', 'released']\n", proc.stderr[-2000:]
    assert proc.returncode == (0 if how == "end" else 1) and "cannot schedule" not in proc.stderr, proc.stderr
