"""Fault injection: SIGKILL at random moments of a ~100 MB save, and a file-size limit hit mid-write.

The kills run in forkserver children (torch preloaded, so a trial costs a fork, not an import);
each trial saves into a folder that already holds a good checkpoint, and afterwards
``CheckpointManager.latest()`` must return a complete, loadable checkpoint: the new one or the
previous one, never a partial one. Run with ``-s`` to see the trial counts.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_resume as dr
from dist_resume._format.atomic import TEMP_NAME
from dist_resume._manager.manager import CheckpointManager
from dist_resume._source.listing import CHECKPOINT_NAME, checkpoint_name
from dist_resume.testing._ranks import _PRELOAD

REPO_ROOT = Path(__file__).resolve().parents[1]
TRIALS = 20
WIDTH = 2048  # 3 layers of 2048x2048 float32 + SGD momentum: ~101 MB on disk
KEEP_LAST = 2
_CTX = mp.get_context("forkserver")
# applies when the fork server starts; the server is one per process, shared with dist_resume.testing.run_ranks, hence
# its list: torch, and torch._dynamo, which building the first optimizer imports (a trial took 3 s instead of 0.3 s)
_CTX.set_forkserver_preload(_PRELOAD)


def _big(step: int, width: int = WIDTH) -> tuple[nn.Module, torch.optim.Optimizer]:
    """~50 MB of parameters (at WIDTH) equal to ``step`` and momentum buffers equal to ``step + 0.5``."""
    model = nn.Sequential(*(nn.Linear(width, width, bias=False, device="meta") for _ in range(3)))
    model.to_empty(device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(step))
            opt.state[p]["momentum_buffer"] = torch.full_like(p, step + 0.5)
    return model, opt


def _save_child(folder: str, step: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    model, opt = _big(step)
    mgr = CheckpointManager(folder, keep_last=KEEP_LAST)
    conn.send(("ready", time.monotonic()))
    mgr.save(step, model=model, optimizer=opt)
    conn.send(("done", time.monotonic()))


ASYNC_WIDTH = 1024  # ~25 MB on disk: the async trials check the background thread, not the size


def _save_async_child(folder: str, step: int, conn: Connection) -> None:
    """Even steps: ``CheckpointManager.save_async``; odd steps: ``save_checkpoint_async`` into the folder."""
    torch.set_num_threads(1)
    model, opt = _big(step, ASYNC_WIDTH)
    mgr = CheckpointManager(folder, keep_last=KEEP_LAST)
    conn.send(("ready", time.monotonic()))
    if step % 2 == 0:
        handle = mgr.save_async(step, model=model, optimizer=opt)
    else:
        Path(folder).mkdir(parents=True, exist_ok=True)
        handle = dr.save_checkpoint_async(Path(folder) / checkpoint_name(step), model=model, optimizer=opt, step=step)
    with torch.no_grad():  # training goes on while the thread writes: the file must still hold ``step``
        for p in model.parameters():
            p.fill_(-7.0)
    handle.wait()
    conn.send(("done", time.monotonic()))
    mgr.close()


def _run_child(
    folder: Path, step: int, kill_after: float | None, target: Callable[..., None] = _save_child
) -> float | None:
    """Save ``step`` in a child; SIGKILL it ``kill_after`` seconds after it starts saving.

    Returns how long the save took when it finished, None when the kill interrupted it.
    """
    reader, writer = _CTX.Pipe(duplex=False)
    proc = _CTX.Process(target=target, args=(str(folder), step, writer), daemon=True)
    proc.start()
    writer.close()
    try:
        if not reader.poll(60):
            raise AssertionError("the saving child did not start within 60 s")
        try:
            _, started = reader.recv()
        except EOFError:
            proc.join(10)
            raise AssertionError(f"the saving child died before saving (exit code {proc.exitcode})") from None
        if kill_after is None:
            if not reader.poll(60):
                raise AssertionError("an uninterrupted save took more than 60 s")
            return float(reader.recv()[1] - started)
        time.sleep(max(0.0, started + kill_after - time.monotonic()))
        try:
            os.kill(proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        except ProcessLookupError:  # it had already finished and exited
            pass
        proc.join(10)
        try:
            return float(reader.recv()[1] - started)
        except EOFError:  # killed before it could report
            return None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(10)
        reader.close()


def _check_folder(folder: Path, previous: int, new: int, width: int = WIDTH) -> tuple[str, list[str]]:
    """Which checkpoint latest() returns ('new'/'previous'), and every broken promise found."""
    problems = []
    names = sorted(n for n in os.listdir(folder) if CHECKPOINT_NAME.match(n))
    latest = CheckpointManager(folder).latest()  # verify=True: zip structure, every CRC, metadata
    if latest is None:
        return "none", [f"latest() found no complete checkpoint among {names}"]
    if latest.name != names[-1]:  # the completion rule: a checkpoint name means a complete file
        problems.append(f"{names[-1]} carries a checkpoint name but is not complete (latest() skipped it)")
    model, opt = _big(-1, width)
    step = dr.resume(latest, model=model, optimizer=opt, options=dr.ResumeOptions(rng=False)).step
    if step is None or step not in (previous, new):
        return "wrong step", problems + [f"latest() returned step {step}, expected {previous} or {new}"]
    if not all(bool(torch.all(p == step)) for p in model.parameters()):
        problems.append(f"{latest.name}: parameters differ from what step {step} saved")
    if not all(bool(torch.all(s["momentum_buffer"] == step + 0.5)) for s in opt.state.values()):
        problems.append(f"{latest.name}: momentum buffers differ from what step {step} saved")
    return ("new" if step == new else "previous"), problems


@pytest.mark.slow  # ~25 s: the async trials below cover the same atomic write in every CI run
def test_sigkill_at_random_moments_never_leaves_a_partial_latest(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    durations = [d for step in (1, 2) if (d := _run_child(folder, step, None)) is not None]  # a good one there
    size_mb = (folder / checkpoint_name(2)).stat().st_size / 1e6
    assert size_mb > 95
    rng = random.Random(20240605)
    previous = 2
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    left_behind = 0
    for trial in range(TRIALS):
        new = 3 + trial
        # stratified over [0, 1.3 x the median save time so far]: kills land before, during and after the write
        kill_after = statistics.median(durations) * 1.3 * (trial + rng.random()) / TRIALS
        stale = {n for n in os.listdir(folder) if TEMP_NAME.match(n)}
        took = _run_child(folder, new, kill_after)
        finished = took is not None
        durations += [took] if took is not None else []
        fresh = {n for n in os.listdir(folder) if TEMP_NAME.match(n)} - stale
        left_behind += len(fresh)
        phases[
            "finished"
            if finished
            else "killed after the rename"
            if (folder / checkpoint_name(new)).exists()
            else "killed mid-write"
            if fresh
            else "killed before writing"
        ] += 1
        outcome, problems = _check_folder(folder, previous, new)
        outcomes[outcome] += 1
        failures += [f"trial {trial} (kill at {kill_after:.3f}s): {p}" for p in problems]
        previous = new if outcome == "new" else previous
    _run_child(folder, 1000, None)  # the next save cleans what killed saves left behind
    left = sorted(os.listdir(folder))
    remaining = sum(1 for n in left if TEMP_NAME.match(n))
    print(
        f"\nfault injection: {TRIALS} SIGKILL trials of a {size_mb:.0f} MB save "
        f"(uninterrupted: median {statistics.median(durations):.2f}s); "
        f"{len(failures)} failures; latest() returned {dict(outcomes)}; kills: {dict(phases)}; "
        f"temp files left by killed saves: {left_behind}, remaining after the next save: {remaining}"
    )
    assert not failures, "\n".join(failures)
    assert phases["killed mid-write"] >= 1, f"no kill landed mid-write: {dict(phases)}"
    assert remaining == 0
    assert left == [".dist_resume.lock", checkpoint_name(previous), checkpoint_name(1000)], left


@pytest.mark.e2e
def test_sigkill_during_async_saves_always_leaves_a_complete_latest(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    durations = [d for step in (1, 2) if (d := _run_child(folder, step, None, _save_async_child)) is not None]
    rng = random.Random(20261202)
    previous = 2
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    phases: Counter[str] = Counter()
    before, after = 0.0, statistics.median(durations[:2]) * 2  # kill times known to land before / after the write

    def trial(new: int, kill_after: float) -> None:
        nonlocal previous, before, after
        stale = {n for n in os.listdir(folder) if TEMP_NAME.match(n)}
        took = _run_child(folder, new, kill_after, _save_async_child)
        durations.extend([took] if took is not None else [])
        fresh = {n for n in os.listdir(folder) if TEMP_NAME.match(n)} - stale
        phase = (
            "finished"
            if took is not None
            else "killed after the rename"
            if (folder / checkpoint_name(new)).exists()
            else "killed mid-write"
            if fresh
            else "killed before writing"
        )
        phases[phase] += 1
        if phase == "killed before writing":
            before = max(before, kill_after)
        elif phase != "killed mid-write":
            after = min(after, kill_after if took is None else took)
        outcome, problems = _check_folder(folder, previous, new, ASYNC_WIDTH)
        outcomes[outcome] += 1
        failures.extend(f"step {new} (kill at {kill_after:.3f}s): {p}" for p in problems)
        previous = new if outcome == "new" else previous

    for i in range(TRIALS):
        # stratified over [0, 2 x the first two saves' median]: kills land before, during and after the write
        trial(3 + i, statistics.median(durations[:2]) * 2 * (i + rng.random()) / TRIALS)
    extra = 0
    while phases["killed mid-write"] == 0 and extra < 12 and after > before:
        # the write window lies between the latest kill that came too early and the earliest that came too late:
        # aim inside it (the machine's speed moves it, so a fixed schedule alone can miss it)
        trial(3 + TRIALS + extra, before + (after - before) * rng.uniform(0.3, 0.7))
        extra += 1
    print(
        f"\nasync fault injection: {TRIALS} SIGKILL trials (+{extra} aimed) of save_async / save_checkpoint_async "
        f"(uninterrupted: median {statistics.median(durations):.2f}s); {len(failures)} failures; "
        f"latest() returned {dict(outcomes)}; kills: {dict(phases)}"
    )
    assert not failures, "\n".join(failures)
    assert phases["killed mid-write"] >= 1, f"no kill landed while the background thread wrote: {dict(phases)}"


_RLIMIT_CHILD = textwrap.dedent("""
    import resource, signal, sys
    import torch
    from dist_resume._manager.manager import CheckpointManager
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write() instead of being killed
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
    model = torch.nn.Linear(1024, 1024)  # 4 MB, over the 1 MB limit
    try:
        CheckpointManager(sys.argv[1], keep_last=1).save(2, model=model)
    except Exception as err:
        print(type(err).__name__)
        print(err)
    else:
        print("saved")
""")


def test_file_size_limit_gives_a_clear_error_and_keeps_the_previous(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path, keep_last=1) as mgr:  # released: the child saves into the same folder
        good = mgr.save(1, model=nn.Linear(4, 4))
    before = good.read_bytes()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _RLIMIT_CHILD, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    kind, _, message = out.stdout.partition("\n")
    assert kind == "CheckpointWriteError", out.stdout + out.stderr
    assert "EFBIG" in message and "ulimit -f" in message and str(tmp_path / checkpoint_name(2)) in message
    assert "previous checkpoint (if any) is untouched" in message
    assert sorted(os.listdir(tmp_path)) == [".dist_resume.lock", good.name]  # no temp file, no partial ckpt_2
    assert good.read_bytes() == before and mgr.latest() == good
