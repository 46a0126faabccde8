"""One writer per checkpoint folder: CheckpointManager's flock on ``<folder>/.dist_resume.lock``."""

from __future__ import annotations

import gc
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._convert.convert import remove_stale_temps
from dist_resume._manager.lock import LOCK_NAME
from dist_resume._manager.manager import CheckpointManager
from dist_resume._source.listing import checkpoint_name

REPO_ROOT = Path(__file__).resolve().parents[1]

_HOLDER = textwrap.dedent("""
    import sys, torch
    from dist_resume._manager.manager import CheckpointManager
    mgr = CheckpointManager(sys.argv[1], keep_last=5)
    mgr.save(int(sys.argv[2]), model=torch.nn.Linear(2, 2))
    print("holding", flush=True)
    sys.stdin.readline()  # hold the lock until the test closes stdin (or kills us)
    mgr.close()
""")


@contextmanager
def _holder(folder: Path, step: int = 1) -> Iterator[subprocess.Popen[str]]:
    """A child process that saved ``step`` into ``folder`` and holds its manager open."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder), str(step)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "holding":
            proc.kill()
            raise AssertionError(f"the holder did not start: {line!r} {proc.communicate(timeout=30)[1]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def _linear(value: float) -> nn.Linear:
    model = nn.Linear(2, 2)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def test_a_second_process_is_refused_naming_the_folder_and_holder_before_writing(tmp_path: Path) -> None:
    with _holder(tmp_path, step=1) as proc:
        before = {name: (tmp_path / name).stat().st_mtime_ns for name in os.listdir(tmp_path)}
        mgr = CheckpointManager(tmp_path, keep_last=1)
        for save in (mgr.save, mgr.save_async):
            with pytest.raises(dr.errors.CheckpointWriteError) as info:
                save(2, model=_linear(2.0))
            message = str(info.value)
            assert str(tmp_path) in message and f"pid {proc.pid}" in message, message
            assert f"host {socket.gethostname()}" in message and "another job" in message, message
        # a second job's resume is refused at once, naming the holder, before it reads (or trains) anything
        model = _linear(5.0)
        with pytest.raises(dr.errors.CheckpointWriteError) as info:
            CheckpointManager(tmp_path, model=model).resume()
        message = str(info.value)
        assert "takes the folder's write lock before it reads anything" in message, message
        assert str(tmp_path) in message and f"pid {proc.pid}" in message and "another job" in message, message
        assert all(torch.all(p == 5.0) for p in model.parameters())
        # nothing written, nothing rotated, no temporary file: the refusal came first
        assert {name: (tmp_path / name).stat().st_mtime_ns for name in os.listdir(tmp_path)} == before
        # readers need no lock
        assert dr.tools.latest_checkpoint(tmp_path) == tmp_path / checkpoint_name(1)
        assert mgr.checkpoints() == [tmp_path / checkpoint_name(1)] and mgr.latest() == tmp_path / checkpoint_name(1)
        model = nn.Linear(2, 2)
        assert dr.resume(tmp_path, model=model, options=dr.ResumeOptions(rng=False)).step == 1
        assert proc.stdin is not None
        proc.stdin.close()  # the holder closes its manager and exits
        assert proc.wait(timeout=60) == 0
    assert mgr.save(2, model=_linear(2.0)) == tmp_path / checkpoint_name(2)
    assert [p.name for p in mgr.checkpoints()] == [checkpoint_name(2)]  # keep_last=1 rotated the holder's
    mgr.close()


def test_sigkill_of_the_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    with _holder(tmp_path, step=1) as proc:
        with pytest.raises(dr.errors.CheckpointWriteError, match=f"pid {proc.pid}"):
            CheckpointManager(tmp_path).save(2, model=_linear(2.0))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert (tmp_path / LOCK_NAME).read_text().strip()  # the killed holder's note is still there...
    with CheckpointManager(tmp_path) as mgr:  # ...but the lock went with the process
        assert mgr.save(2, model=_linear(2.0)).exists()
        assert f"pid={os.getpid()}" in mgr.lock_path.read_text()
    assert mgr.lock_path.read_text() == ""  # released: no holder named


def test_a_second_manager_in_the_same_process_is_refused_until_the_first_closes(tmp_path: Path) -> None:
    first = CheckpointManager(tmp_path)
    second = CheckpointManager(tmp_path)
    assert not (tmp_path / LOCK_NAME).exists()  # lazily: constructing a manager takes no lock
    first.save(1, model=_linear(1.0))
    with pytest.raises(dr.errors.CheckpointWriteError, match="this very process") as info:
        second.save(2, model=_linear(2.0))
    assert str(tmp_path) in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    with pytest.raises(dr.errors.CheckpointWriteError, match="this very process"):
        second.resume(model=_linear(2.0))  # resuming takes the lock too
    assert first.save(2, model=_linear(2.0)).exists()  # the holder keeps saving
    first.close()
    first.close()  # idempotent
    assert second.save(3, model=_linear(3.0)).exists()
    with pytest.raises(dr.errors.CheckpointWriteError, match="this very process"):
        first.save(4, model=_linear(4.0))  # a closed manager takes the lock again on its next save
    del second, info  # the traceback of the refusal refers to the manager too
    gc.collect()  # a manager that is garbage-collected releases its lock
    assert first.save(4, model=_linear(4.0)).exists()
    first.close()


def test_a_read_only_manager_never_takes_the_lock(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as writer:
        writer.save(1, model=_linear(1.0))
        reader = CheckpointManager(tmp_path)
        assert reader.latest() == tmp_path / checkpoint_name(1)
        assert reader.checkpoints() == [tmp_path / checkpoint_name(1)]
        reader.close()  # closing a manager that never saved is harmless
        assert writer.save(2, model=_linear(2.0)).exists()


def test_the_lock_file_is_neither_a_checkpoint_nor_a_temp_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with CheckpointManager(tmp_path, keep_last=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, model=_linear(float(step)))
        caplog.clear()  # the save lines logged at INFO above
        with caplog.at_level(logging.WARNING, logger="dist_resume"):
            assert mgr.latest() == tmp_path / checkpoint_name(3)
        assert not caplog.records  # not skipped as a damaged checkpoint either
        assert remove_stale_temps(tmp_path / checkpoint_name(9)) == []
        assert remove_stale_temps(tmp_path / LOCK_NAME) == []
    assert sorted(os.listdir(tmp_path)) == [LOCK_NAME, checkpoint_name(3)]


def test_close_waits_for_the_pending_async_save_and_with_releases(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path) as mgr:
        handle = mgr.save_async(1, model=_linear(1.0))
    assert handle.done() and handle.wait() == tmp_path / checkpoint_name(1)
    with CheckpointManager(tmp_path) as again:  # released by the with block
        assert again.save(2, model=_linear(2.0)).exists()


def test_an_error_inside_with_is_not_hidden_and_the_lock_is_released(tmp_path: Path) -> None:
    with pytest.raises(KeyError, match="boom"), CheckpointManager(tmp_path) as mgr:
        mgr.save(1, model=_linear(1.0))
        raise KeyError("boom")
    with CheckpointManager(tmp_path) as again:
        assert again.save(2, model=_linear(2.0)).exists()


_FORKS_THEN_DIES = textwrap.dedent("""
    import multiprocessing, os, signal, sys, time, torch
    from dist_resume._manager.lock import FolderLock
    from pathlib import Path

    def worker():  # a DataLoader worker forked by rank 0 while it held the lock
        time.sleep(60)

    lock = FolderLock(Path(sys.argv[1]))
    lock.acquire()
    child = multiprocessing.get_context("fork").Process(target=worker, daemon=False)
    child.start()
    print(child.pid, flush=True)
    sys.stdin.readline()
    os.kill(os.getpid(), signal.SIGKILL)  # rank 0 dies; its worker lives on
""")

_PASSES_THE_LOCK_ON = textwrap.dedent("""
    import os, subprocess, sys
    from dist_resume._manager.lock import FolderLock
    from pathlib import Path

    lock = FolderLock(Path(sys.argv[1]))
    lock.acquire()
    child = subprocess.Popen(["sleep", "60"], pass_fds=[lock._fd])  # the descriptor handed on, not forked
    print(child.pid, flush=True)
    os._exit(0)
""")


def _run(code: str, folder: Path) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(folder)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def test_a_worker_forked_while_the_lock_was_held_does_not_keep_it_after_its_parent_died(tmp_path: Path) -> None:
    proc, worker = _run(_FORKS_THEN_DIES, tmp_path)
    try:
        with pytest.raises(dr.errors.CheckpointWriteError, match=f"pid {proc.pid}"):
            CheckpointManager(tmp_path).save(1, model=_linear(1.0))  # held while the parent lives
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=30) == -signal.SIGKILL
        os.kill(worker, 0)  # the forked worker still runs...
        with CheckpointManager(tmp_path) as mgr:  # ...and the relaunch takes the lock at once
            assert mgr.save(1, model=_linear(1.0)).exists()
    finally:
        os.kill(worker, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_refusal_names_the_live_process_holding_the_lock_when_its_taker_has_exited(tmp_path: Path) -> None:
    proc, holder = _run(_PASSES_THE_LOCK_ON, tmp_path)
    try:
        assert proc.wait(timeout=30) == 0  # the taker exited; the process it handed the lock to holds it
        with pytest.raises(dr.errors.CheckpointWriteError) as info:
            CheckpointManager(tmp_path, model=_linear(1.0)).resume()
        message = str(info.value)
        assert f"pid {holder} (sleep 60)" in message and f"pid {proc.pid}" in message, message
        assert "which has exited" in message, message
    finally:
        os.kill(holder, signal.SIGKILL)
