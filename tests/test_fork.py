"""dist_resume/_core/fork.py: a fork waits until no thread holds the interpreter's thread-list lock (CPython < 3.12)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from types import FrameType

import pytest

import dist_resume  # noqa: F401  its import registers the handler

pytestmark = pytest.mark.skipif(
    sys.version_info >= (3, 12) or not hasattr(os, "fork"), reason="CPython 3.12 re-initialises the lock itself"
)
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fork_after_collective.py"


def test_every_fork_takes_the_thread_list_lock_in_the_forking_process_first(monkeypatch):
    calls: list[int] = []
    real = sys._current_frames

    def recorded() -> dict[int, FrameType]:
        calls.append(os.getpid())
        return real()

    monkeypatch.setattr(sys, "_current_frames", recorded)
    pid = os.fork()
    if pid == 0:  # the child: the handler ran in the parent, before the fork
        os._exit(0 if calls == [os.getppid()] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert calls == [os.getpid()]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_no_fork_after_a_collective_hangs_with_dist_resume_imported():
    # 2 x 2,000 forks per arm on loaded cores: plain torch hung about 1 fork in 700 here (35 of 24,000)
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--forks", "2000"], capture_output=True, text=True, timeout=580, check=True
    ).stdout
    print(out)
    guarded = re.search(r"with dist_resume imported\s+(\d+)\s+(\d+)", out)
    assert guarded is not None, out
    assert guarded.groups() == ("0", "4000"), out
