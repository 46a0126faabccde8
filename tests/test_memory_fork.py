"""Only the process that made the manager acts: children forked from it (a DataLoader's workers, ``multiprocessing``
with fork, ``os.fork``) never copy a snapshot into the folder, never commit, never touch the slots (FACTS 43).

Each case is a user script in a process of its own, which ends with ``os._exit`` (as a kill would) once it has
listed the folder, so that nothing the parent does at its own end is counted. The torchrun case, with SIGTERM
reaching the workers of two DataLoaders, is tests/dist/test_memory_workers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from dist_resume._shm import place

_FORKED = textwrap.dedent(
    """
    import json, multiprocessing, os, sys, torch, dist_resume as dr
    from torch.utils.data import DataLoader, TensorDataset
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = TensorDataset(torch.randn(16, 4))
    early = DataLoader(data, batch_size=4, num_workers=2, persistent_workers=True)
    next(iter(early))  # its workers forked before any snapshot, alive through the run
    mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
    for step in (1, 2, 3):
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        mgr.snapshot(step)
    for _ in DataLoader(data, batch_size=4, num_workers=2):  # workers forked after the snapshots, ended with the epoch
        pass
    for _ in early:
        pass
    del early  # its workers, forked before the snapshots, end now
    pid = os.fork()
    if pid == 0:  # a child that ends the normal way: its exit hooks run
        sys.exit(0)
    os.waitpid(pid, 0)
    child = multiprocessing.get_context("fork").Process(target=print, args=("forked",))
    child.start()
    child.join()
    files = sorted(p.name for p in mgr.folder.glob("*ckpt_*"))
    print(json.dumps({"folder": files, "newest": mgr._memory.newest.step}), flush=True)
    os._exit(0)
    """
)


def test_children_forked_before_and_after_snapshots_write_nothing(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _FORKED, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    assert '"newest": 3' in said, said[-3000:]
    assert '"folder": []' in said, said[-3000:]  # no checkpoint: save() was never called
    assert "Traceback" not in said and "WARNING" not in said, said[-3000:]


_NOTICE = textwrap.dedent(
    """
    import multiprocessing, os, signal, subprocess, sys, time, torch, dist_resume as dr
    from torch.utils.data import DataLoader, TensorDataset

    def gone(pid):  # dead: a zombie not reaped yet, or reaped
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in "ZX"
        except FileNotFoundError:
            return True

    def scripts_own(signum, frame):  # installed before the manager's, as coverage's sigterm = true is
        # the workers die of the same notice while this runs (torchrun signals their group; a worker ends at a SIGTERM
        # from anyone but its parent, and one slow to be scheduled ends late)
        subprocess.run(["kill", "-TERM", *map(str, workers)], check=True)
        deadline = time.monotonic() + 30
        while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(20):  # Python code runs with the workers' SIGCHLD delivered
            time.sleep(0.01)
        print(f"the script's handler ran to its end, {sum(map(gone, workers))} workers dead", flush=True)
        sys.exit(143)

    signal.signal(signal.SIGTERM, scripts_own)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4, num_workers=2)
    batches = iter(loader)
    mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt)
    model(next(batches)[0]).sum().backward()
    opt.step()
    mgr.snapshot(1)
    workers = [p.pid for p in multiprocessing.active_children()]
    os.kill(os.getpid(), signal.SIGTERM)  # the notice
    time.sleep(60)
    """
)


def test_a_notice_passed_on_to_the_scripts_handler_raises_no_dataloader_error_inside_it(tmp_path: Path) -> None:
    """The DataLoader's SIGCHLD handler stays off while the SIGTERM handler installed before the manager's runs: the
    workers' deaths from the same notice raised "DataLoader worker (pid …) is killed by signal" inside it."""
    (tmp_path / "shm").mkdir()
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _NOTICE, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120
    )
    said = out.stdout + out.stderr
    assert out.returncode == 143, said[-3000:]
    assert "the script's handler ran to its end, 2 workers dead" in said, said[-3000:]
    assert "DataLoader worker (pid" not in said and "Traceback" not in said, said[-3000:]
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*")) == ["ckpt_00000001.pt"], said[-3000:]
