"""The write lease of a folder on an object store never blocks a relaunch of the same job, and never lets two jobs
write: who a lease names and when its holder is gone (dist_resume/_manager/holder.py), the wait and its refusal, a
relaunch after a SIGKILL (real processes, against the test session's S3 server), and two relaunches racing for a dead
holder's lease. The torchrun ``--max-restarts`` restart is tests/dist/test_s3_restart.py."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch import nn

import dist_resume as dr
from dist_resume._manager import lease as lease_mod
from dist_resume._manager.holder import Holder, process_gone, takeover_reason, this_process
from dist_resume._manager.lease import LEASE_NAME, WAIT_ENV, PrefixLease, wait_seconds
from dist_resume._manager.lease_object import Lease
from dist_resume._store.upload import read_tagged
from dist_resume._store.url import location
from dist_resume.errors import CheckpointWriteError, UsageError
from dist_resume.testing import kill_tree

fsspec = pytest.importorskip("fsspec")

REPO_ROOT = Path(__file__).resolve().parents[1]

# the first job: takes the folder's lease, saves, and trains on (sleeps) until it is killed
_HOLDS = textwrap.dedent("""
    import sys, time, torch, dist_resume as dr
    mgr = dr.CheckpointManager(sys.argv[1], model=torch.nn.Linear(4, 4))
    mgr.resume()
    mgr.save(1)
    time.sleep(300)
""")
# the relaunch: resumes and saves, printing when its resume returned
_RELAUNCH = textwrap.dedent("""
    import time
    began = time.time()
    import sys, torch, dist_resume as dr
    with dr.CheckpointManager(sys.argv[1], model=torch.nn.Linear(4, 4)) as mgr:
        imported = time.time()
        result = mgr.resume()
        print(f"RESUMED {result.step} {began} {imported} {time.time()}", flush=True)
        mgr.save(2)
""")


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHELASTIC_")}
    return {**env, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def _exists(fs: object, url: str) -> bool:
    fs.invalidate_cache()  # type: ignore[attr-defined]
    return bool(fs.exists(url))  # type: ignore[attr-defined]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process of this host, killed afterwards."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield proc
    finally:
        kill_tree(proc.pid)
        proc.wait()


def _as(proc_pid: int, me: Holder, **fields: object) -> Holder:
    """A holder of this host with pid ``proc_pid`` and the process's real start time, changed by ``fields``."""
    base = {"host": me.host, "pid": proc_pid, "node": me.node, "start": None, "job": None, "generation": None}
    if sys.platform == "linux":
        with open(f"/proc/{proc_pid}/stat") as f:
            base["start"] = int(f.read().rsplit(")", 1)[1].split()[19])
    return Holder(**{**base, **fields})  # type: ignore[arg-type]


def test_who_a_lease_names_and_when_its_holder_is_gone(
    monkeypatch: pytest.MonkeyPatch, sleeper: subprocess.Popen[bytes]
) -> None:
    """A live process of this host is never taken over, even by a later generation of its job; a dead one (reaped,
    zombie, or its pid reused) is; a holder on another host only by a later generation of the same torchrun job."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    me = this_process()
    assert (me.pid, me.host, me.job, me.generation) == (os.getpid(), socket.gethostname(), "job-a", 1)
    assert me.node is not None and me.same_host(me)

    live = _as(sleeper.pid, me)
    assert not process_gone(live) and takeover_reason(live, me) is None
    assert takeover_reason(_as(sleeper.pid, me, job="job-a", generation=0), me) is None  # alive here: never
    assert takeover_reason(_as(os.getpid(), me, job="job-a", generation=0), me) is None  # this very process
    if sys.platform == "linux":
        reused = _as(sleeper.pid, me, start=live.start - 1)  # type: ignore[operator]
        assert process_gone(reused) and "gone from this host" in str(takeover_reason(reused, me))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_holder = _as(dead.pid, me, job="job-b", generation=0)  # another job
    dead.wait()
    if sys.platform == "linux":
        zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        zombie_holder = _as(zombie.pid, me)
        zombie.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not process_gone(zombie_holder) and time.monotonic() < deadline:  # SIGKILLed, not reaped yet
            time.sleep(0.05)
        assert process_gone(zombie_holder) and zombie.poll() == -signal.SIGKILL
    assert process_gone(dead_holder)
    assert takeover_reason(dead_holder, me) == f"its process (pid {dead.pid}) is gone from this host"

    elsewhere = Holder("other-host", 4242, "boot/pid:[1]", 7, "job-a", 0)
    assert "torchrun restarted its job job-a (generation 0, now 1)" in str(takeover_reason(elsewhere, me))
    for not_restarted in (
        Holder("other-host", 4242, "boot/pid:[1]", 7, "job-a", 1),  # the same generation: a live job's writer
        Holder("other-host", 4242, "boot/pid:[1]", 7, "job-a", 2),
        Holder("other-host", 4242, "boot/pid:[1]", 7, "job-b", 0),
        Holder("other-host", 4242, "boot/pid:[1]", 7, None, None),
        Holder(me.host, dead.pid, "another-boot/pid:[1]", None, None, None),  # another boot or container
        Holder(me.host, dead.pid, None, None, None, None),  # an older lease: its pid cannot be judged
    ):
        assert takeover_reason(not_restarted, me) is None, not_restarted
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default run id names no job
    assert (this_process().job, this_process().generation) == (None, None)


def test_a_lease_object_is_parsed_totally_and_the_wait_is_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    old = b'{"host": "h", "pid": 3, "since": 1.0, "expires": 2.0, "token": "t"}'  # an older dist_resume's
    assert Lease.from_json(old) == Lease("h", 3, 1.0, 2.0, "t")
    for damaged in (b"", b"[]", b"null", b'{"host": "h"}', old.replace(b"3", b'"x"'), b'{"pid": 1e999}', b"\xff"):
        assert Lease.from_json(damaged) is None, damaged
    lease = Lease("h", 3, 1.0, 2.0, "t", "n", 5, "job", 0)
    assert Lease.from_json(lease.to_json()) == lease
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert wait_seconds() == 75.0
    monkeypatch.setenv(WAIT_ENV, "0")
    assert wait_seconds() == 0.0
    for bad in ("-1", "soon", "inf", "nan"):
        monkeypatch.setenv(WAIT_ENV, bad)
        with pytest.raises(UsageError, match=WAIT_ENV):
            wait_seconds()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_live_job_is_refused_after_the_wait_and_a_relaunch_after_its_sigkill_resumes_at_once(
    s3_bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A job holding the lease (a real process) refuses a second job, even a later generation of its own torchrun
    job on this host, after the wait; SIGKILLed, its lease is taken over at once by a relaunch of another job."""
    url, fs = f"{s3_bucket}/run", fsspec.filesystem("s3")
    log = (tmp_path / "first.log").open("w+")
    first = subprocess.Popen(
        [sys.executable, "-c", _HOLDS, url],
        env=_env(TORCHELASTIC_RUN_ID="job-a", TORCHELASTIC_RESTART_COUNT="0"),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        while not _exists(fs, f"{url}/ckpt_00000001.pt"):
            assert first.poll() is None and time.monotonic() < deadline, log.seek(0) or log.read()[-3000:]
            time.sleep(0.2)
        monkeypatch.setenv(WAIT_ENV, "1")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
        began = time.monotonic()
        with caplog.at_level(logging.INFO, logger="dist_resume"):
            with pytest.raises(CheckpointWriteError, match=f"pid {first.pid}, torchrun job job-a generation 0") as info:
                dr.CheckpointManager(url, model=nn.Linear(4, 4)).resume()
        waited = time.monotonic() - began
        message = str(info.value)
        assert 1.0 <= waited < 20, waited
        assert f"host {socket.gethostname()}" in message and "a live process of this host" in message
        assert "waited 1 s" in message and WAIT_ENV in message and LEASE_NAME in message and "held " in message
        assert [r.getMessage() for r in caplog.records if "waiting up to 1 s" in r.getMessage()] != []
        lease = Lease.from_json(fs.cat_file(f"{url}/{LEASE_NAME}"))
        assert lease is not None and lease.pid == first.pid and lease.job == "job-a"

        first.send_signal(signal.SIGKILL)
        killed = time.time()
        first.wait(timeout=30)
        relaunch = subprocess.run(
            [sys.executable, "-c", _RELAUNCH, url],
            env=_env(TORCHELASTIC_RUN_ID="job-b", TORCHELASTIC_RESTART_COUNT="0", **{WAIT_ENV: "0"}),
            capture_output=True,
            text=True,
            timeout=90,
        )
    finally:
        if first.poll() is None:
            kill_tree(first.pid)
            first.wait()
        log.close()
    assert relaunch.returncode == 0, relaunch.stderr[-3000:]
    resumed = [line.split() for line in relaunch.stdout.splitlines() if line.startswith("RESUMED ")]
    assert [r[1] for r in resumed] == ["1"]
    began, imported, done = (float(t) for t in resumed[0][2:])
    print(
        f"SIGKILL to a resumed relaunch: {done - killed:.2f} s (start {began - killed:.2f} s, imports "
        f"{imported - began:.2f} s, resume with the takeover {done - imported:.2f} s)"
    )
    assert f"pid {first.pid}" in relaunch.stderr and "is gone from this host" in relaunch.stderr, relaunch.stderr
    assert not _exists(fs, f"{url}/{LEASE_NAME}")  # the relaunch closed its manager


@pytest.mark.timeout(60)
def test_two_relaunches_racing_for_a_dead_holders_lease_one_wins(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each contender reads the dead holder's lease before any of them replaces it: the conditional put lets one
    replace it; the others find the winner's lease (this process's: refused at once)."""
    url, fs = f"{s3_bucket}/race", fsspec.filesystem("s3")
    me = this_process()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = Lease(me.host, dead.pid, time.time() - 30, time.time() + 50, "d" * 32, me.node, None, "job-old", 0)
    fs.pipe_file(f"{url}/{LEASE_NAME}", stale.to_json())
    contenders = 3
    met = threading.Barrier(contenders)
    read = read_tagged
    first_reads: list[int] = []

    def read_then_meet(path: object) -> object:
        found = read(path)  # type: ignore[arg-type]
        if len(first_reads) < contenders and threading.get_ident() not in first_reads:
            first_reads.append(threading.get_ident())
            met.wait(timeout=20)  # every contender has read the dead holder's lease
            time.sleep(0.2 * first_reads.index(threading.get_ident()))  # their puts reach the server one by one
        return found

    monkeypatch.setattr(lease_mod, "read_tagged", read_then_meet)
    leases = [PrefixLease(location(url), wait=0) for _ in range(contenders)]  # type: ignore[arg-type]
    outcomes: list[str] = []

    def contend(lease: PrefixLease) -> None:
        try:
            lease.acquire()
            outcomes.append("won")
        except CheckpointWriteError as err:
            outcomes.append("another CheckpointManager of this process" if "of this process" in str(err) else str(err))

    threads = [threading.Thread(target=contend, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=40)
    try:
        assert sorted(outcomes) == ["another CheckpointManager of this process"] * (contenders - 1) + ["won"]
        winner = next(lease for lease in leases if lease.held)
        now = Lease.from_json(fs.cat_file(f"{url}/{LEASE_NAME}"))
        assert now is not None and now.token == winner._token and now.pid == os.getpid()
    finally:
        for lease in leases:
            lease.release()
    assert not _exists(fs, f"{url}/{LEASE_NAME}")
