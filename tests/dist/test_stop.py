"""Stopping a whole torchrun job started by the launch scripts (docs/launching.md, "Stopping a job").

torchrun puts each worker in a session of its own: a signal to the launcher's process group reaches the agent only.
The scripts run the agent in its own session, forward SIGINT/SIGTERM/SIGHUP to it once (it forwards them to its
workers), and stop workers an agent left behind. The workers here are tiny scripts that import nothing heavy.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.dist import harness

pytestmark = pytest.mark.dist

SCRIPT = harness.REPO_ROOT / "launch" / "single_node.sh"
WORKER = textwrap.dedent("""
    import os, signal, sys, time
    out, rank = sys.argv[1], os.environ["RANK"]
    def stop(sig, frame):
        with open(f"{out}/got.{rank}", "w") as f:
            f.write(signal.Signals(sig).name)
        sys.exit(1)
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with open(f"{out}/pid.{rank}.tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getsid(0)}")
    os.rename(f"{out}/pid.{rank}.tmp", f"{out}/pid.{rank}")
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _terminal_signals() -> None:
    """SIGINT and SIGQUIT as a terminal's job gets them. A test run started as a background job (``cmd &`` in a
    script) inherits them ignored, and bash cannot trap a signal ignored when it started: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGQUIT, signal.SIG_DFL)


def _start(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], Path, list[tuple[int, int]]]:
    out = tmp_path / name
    out.mkdir()
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    # no coverage measurement in this job (`.ci/run` measures subprocesses): its processes run no dist_resume code,
    # and writing coverage data on the way out would only lengthen the stop being timed
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("COV")},
        "TRAIN_SCRIPT": str(worker),
        "TORCHRUN": f"{sys.executable} -m torch.distributed.run",
        "NPROC_PER_NODE": "2",
        "STOP_GRACE": "10",
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), str(out)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # like a terminal's job: its own process group
        preexec_fn=_terminal_signals,
    )
    deadline = time.monotonic() + 60
    while len(list(out.glob("pid.?"))) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            harness._kill_tree(proc)  # type: ignore[arg-type]
            raise AssertionError(f"the workers did not start:\n{proc.communicate()[0][-3000:]}")
        time.sleep(0.1)
    workers = [tuple(map(int, p.read_text().split())) for p in sorted(out.glob("pid.?"))]
    return proc, out, workers  # type: ignore[return-value]


def _finish(proc: subprocess.Popen[str], workers: list[tuple[int, int]]) -> str:
    try:
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            harness._kill_tree(proc)  # type: ignore[arg-type]
        for pid, _ in workers:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return output


def test_ctrl_c_stops_the_whole_job_and_a_killed_agent_leaves_no_worker(tmp_path: Path) -> None:
    # Ctrl-C: the terminal sends SIGINT to the script's process group
    proc, out, workers = _start(tmp_path, "ctrl_c")
    agents = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(agents) == 1
    agent = int(agents[0])
    assert os.getsid(agent) == agent != os.getsid(proc.pid)  # the agent in its own session: one signal, forwarded
    for pid, sid in workers:
        assert sid == pid and sid not in (os.getsid(proc.pid), agent)  # torch's: each worker its own session
    os.killpg(proc.pid, signal.SIGINT)
    output = _finish(proc, workers)
    assert proc.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "forwarding it to torchrun" in output
    assert sorted(p.read_text() for p in out.glob("got.*")) == ["SIGINT", "SIGINT"]  # each worker got it
    assert not any(_alive(pid) for pid, _ in [*workers, (agent, 0)])

    # the agent SIGKILLed (it cannot forward anything): the script stops the workers it left behind
    proc, out, workers = _start(tmp_path, "agent_killed")
    (agent,) = map(int, subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split())
    os.kill(agent, signal.SIGKILL)
    output = _finish(proc, workers)
    assert proc.returncode == 128 + signal.SIGKILL, output[-3000:]
    assert "left worker(s) running" in output
    assert sorted(p.read_text() for p in out.glob("got.*")) == ["SIGTERM", "SIGTERM"]
    assert not any(_alive(pid) for pid, _ in workers)
