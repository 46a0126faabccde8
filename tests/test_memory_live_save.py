"""``save(step)`` after ``snapshot(step)`` writes the live state of ``step``: the snapshot's bytes only when nothing
it holds changed since (tensors' version counters, the small states compared whole), the live state otherwise, and
the stale snapshot is never resumed or copied later. A user script in a process of its own (a torchvision-style
loop: a snapshot every step, a per-epoch scheduler and an EMA update between the last snapshot of an epoch and its
save), then a restart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._shm import place

_LOOP = textwrap.dedent(
    """
    import json, os, sys, torch, dist_resume as dr
    from torch.optim.swa_utils import AveragedModel
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: max(0.0, 1 - epoch / 2))  # 0.0 from epoch 2
    ema = AveragedModel(model)
    mgr = dr.CheckpointManager(sys.argv[1], model=model, optimizer=opt, scheduler=sched, ema=ema, keep_last=5)
    result = mgr.resume()
    said = {"resumed": None if result is None else [result.step, result.source], "lr": opt.param_groups[0]["lr"]}
    step = 0 if result is None else result.step
    for epoch in range(step // 3, 3):
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            step += 1
            mgr.snapshot(step)
        if epoch == 0:
            mgr.save(step)  # nothing changed since snapshot(3): its bytes are copied
            continue
        sched.step()  # per epoch, between the epoch's last snapshot and its save
        ema.update_parameters(model)
        if epoch == 2:
            with torch.no_grad():
                model.weight[0, 0] = 42.0  # an edit in place
        mgr.save(step)
    said["live"] = {"lr": opt.param_groups[0]["lr"], "sched": sched.state_dict()["last_epoch"],
                    "n_averaged": int(ema.n_averaged), "w": model.weight[0, 0].item()}
    print(json.dumps(said), flush=True)
    os._exit(0)  # as a kill: the snapshots stay for the restart
    """
)


def _run(tmp_path: Path) -> tuple[dict[str, object], str]:
    env = {**os.environ, place.SHM_DIR_ENV: str(tmp_path / "shm"), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", _LOOP, str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    said = out.stdout + out.stderr
    return json.loads(next(line for line in out.stdout.splitlines() if line.startswith("{"))), said


def test_save_after_snapshot_writes_the_live_state_and_the_stale_snapshot_is_never_resumed(tmp_path: Path) -> None:
    (tmp_path / "shm").mkdir()
    said, log = _run(tmp_path)
    assert said["resumed"] is None
    run = tmp_path / "run"
    assert "ckpt_00000003.pt (step 3" in log and "copied from shared memory" in log, log  # unchanged: the snapshot
    ckpt6 = torch.load(run / "ckpt_00000006.pt", weights_only=True)
    assert ckpt6["scheduler"]["last_epoch"] == 1 and ckpt6["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.005)
    assert int(ckpt6["ema"]["n_averaged"]) == 1
    ckpt9 = torch.load(run / "ckpt_00000009.pt", weights_only=True)
    live = said["live"]
    assert isinstance(live, dict) and live["lr"] == 0.0 and live["w"] == 42.0
    assert ckpt9["scheduler"]["last_epoch"] == live["sched"] == 2
    assert ckpt9["optimizer"]["param_groups"][0]["lr"] == 0.0  # the live lr, not the snapshot's 0.005
    assert int(ckpt9["ema"]["n_averaged"]) == live["n_averaged"] == 2
    assert ckpt9["model"]["weight"][0, 0].item() == 42.0
    # the restart resumes the live state of step 9 from the folder, not the stale snapshot of step 9
    again, _ = _run(tmp_path)
    assert again["resumed"] == [9, "folder"] and again["lr"] == 0.0, again


def test_what_changed_since_the_snapshot_is_told_by_evidence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(place.SHM_DIR_ENV, str(tmp_path / "shm"))
    (tmp_path / "shm").mkdir()
    torch.manual_seed(0)
    big = torch.nn.Linear(512, 1024)  # 2 MiB of weights: compared by version counter, not byte for byte
    norm = torch.nn.BatchNorm1d(1024)
    model = torch.nn.Sequential(big, norm)
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    fused = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)  # writes without bumping a version counter
    other = {k: v + 1 for k, v in model.state_dict().items()}

    def step(opt: torch.optim.Optimizer) -> None:
        model.train(opt is adamw)  # the fused step's forward leaves BatchNorm's statistics (and their counter) alone
        model(torch.ones(2, 512)).sum().backward()
        opt.step()
        opt.zero_grad()
        model.train()

    changes = {
        "nothing": lambda: None,
        "a forward in training mode (BatchNorm's statistics)": lambda: model(torch.randn(3, 512)),
        "an optimizer step": lambda: step(adamw),
        "a fused optimizer step": lambda: step(fused),
        "a hyperparameter": lambda: adamw.param_groups[0].__setitem__("lr", 0.05),
        "torch's RNG": lambda: torch.rand(1),
        "load_state_dict": lambda: model.load_state_dict(other),
        "an edit in place": lambda: torch.nn.init.zeros_(big.weight),
        "nothing, after all that": lambda: None,
    }
    with dr.CheckpointManager(tmp_path / "run", model=model, keep_last=20) as mgr:
        step(adamw)
        step(fused)
        for i, (what, change) in enumerate(changes.items(), start=1):
            opt = fused if "fused" in what else adamw
            mgr.snapshot(i, optimizer=opt)
            change()
            path = mgr.save(i, optimizer=opt)
            mgr._memory._join_copy()
            newest = mgr._memory.newest
            copied = newest is not None and newest.step == i and Path(path).read_bytes() == newest.path.read_bytes()
            assert copied == what.startswith("nothing"), what
            live = torch.load(path, weights_only=True)
            assert torch.equal(live["model"]["0.weight"], big.weight), what
            assert norm.num_batches_tracked is not None
            assert torch.equal(live["model"]["1.num_batches_tracked"], norm.num_batches_tracked), what
        mgr.snapshot(20, extra={"note": "a"})
        path = mgr.save(20, extra={"note": "b"})  # another extra: the live one
        assert torch.load(path, weights_only=True)["extra"] == {"note": "b"}
        mgr.snapshot(21)
        mgr.save_async(21).wait()  # a live save of step 21: the snapshot of 21 no longer stands for it
        assert mgr._memory.newest is None
