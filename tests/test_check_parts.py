"""dist-resume check's pieces, without launching a training run: what counts as a complete checkpoint while a run
writes it, when a launch is stopped, how two runs' checkpoints are paired and compared, what the diagnosis reads
from them, and the whole-tree kill. The command itself, as users run it: tests/test_check_cli.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._core.procs import descendants, marked_processes
from dist_resume.cli.check._command import _stop_rule, command_argv
from dist_resume.cli.check._compare import PairResult, compare_pair, folder_checkpoints, pairs_to_compare
from dist_resume.cli.check._diagnose import diagnose
from dist_resume.cli.check._evidence import Evidence
from dist_resume.cli.check._launch import Launch, Seen, StopRule, StopSignal, _due
from dist_resume.cli.check._result import Cause, ResumeCheck
from dist_resume.cli.check._watch import SETTLE_S, FolderWatch, step_of
from dist_resume.errors import UsageError
from dist_resume.testing import kill_tree
from tests.helpers import save_with_device_tag


def test_names_give_steps_and_only_complete_checkpoints_count(tmp_path: Path) -> None:
    assert [step_of(n) for n in ("ckpt_00000012.pt", "checkpoint-500", "epoch_3.pt", "snapshot.pt")] == [
        12,
        500,
        3,
        None,
    ]
    watch = FolderWatch(tmp_path)
    torch.save({"w": torch.ones(64)}, tmp_path / "snapshot.pt")
    (tmp_path / "ckpt_00000004.pt").write_bytes(b"renamed into place once durable")
    (tmp_path / ".ckpt_00000008.pt.0123456789abcdef.tmp").write_bytes(b"an atomic save under way")
    (tmp_path / "runs").mkdir()  # a log folder: no number, never a checkpoint
    (tmp_path / "tmp-checkpoint-9").mkdir()
    whole = (tmp_path / "snapshot.pt").read_bytes()
    (tmp_path / "epoch_2.pt").write_bytes(whole[: len(whole) // 2])  # torch.save cut short: no zip end record
    (tmp_path / "model.safetensors").write_bytes(b"not a zip: complete once it stays the same")
    (tmp_path / "checkpoint-10").mkdir()
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text("{}")
    t0 = time.monotonic()
    first = {e.name: e.complete for e in watch.look(t0)}
    assert first == {
        "snapshot.pt": True,
        "ckpt_00000004.pt": True,
        "epoch_2.pt": False,
        "model.safetensors": False,
        "checkpoint-10": False,
    }
    later = {e.name: e.complete for e in watch.look(t0 + SETTLE_S)}
    assert later == {**first, "model.safetensors": True, "checkpoint-10": True}
    before = next(e for e in watch.look(t0) if e.name == "snapshot.pt")
    assert watch.first_seen(before) == t0
    time.sleep(0.01)
    torch.save({"w": torch.zeros(64)}, tmp_path / "snapshot.pt")  # saved again under its name: a new version
    again = next(e for e in watch.look(t0 + 1) if e.name == "snapshot.pt")
    assert again.version != before.version and again.complete and watch.first_seen(again) == t0 + 1
    assert [e.step for e in watch.look(t0 + 2)] == [None, None, 2, 4, 10]  # by step, names without one first


def test_commands_signals_and_stop_rules() -> None:
    assert command_argv("torchrun --nproc_per_node=2 train.py --ckpt {dir}")[-1] == "{dir}"
    assert command_argv(["--", "python", "t.py", "--out={dir}/x"]) == ["python", "t.py", "--out={dir}/x"]
    for bad in ("python train.py", [], ["--"]):
        with pytest.raises(UsageError):
            command_argv(bad)
    assert StopSignal.parse("sigterm") is StopSignal.TERM and StopSignal.parse("KILL") is StopSignal.KILL
    with pytest.raises(UsageError, match="KILL"):
        StopSignal.parse("HUP")
    with pytest.raises(UsageError, match="at least 1"):
        dr.testing.check_resume("python t.py {dir}", interrupts=0)
    # the reference wrote 6 checkpoints, one a second after 10 s of start-up
    ref = Launch("reference", 16.0, 0, None, tuple(Seen(10.0 + i, f"ckpt_{i}", i) for i in range(6)), Path(), Path())
    rng = random.Random(0)
    for _ in range(200):
        first = _stop_rule(ref, -1, rng)  # the first launch: after checkpoint 1..4, never after the last
        assert 1 <= first.checkpoints <= 4 and 0 <= first.delay < 1.0
        resumed = _stop_rule(ref, 2, rng)  # resumed from the third: stopped after its first or second new one
        assert 1 <= resumed.checkpoints <= 2 and 0 <= resumed.delay < 1.0
    assert _stop_rule(ref, 5, rng) == _stop_rule(ref, 4, rng) == StopRule(1, 0.0)  # nothing between: at the next
    seen = [Seen(3.0, "a", 1)]
    assert not _due(StopRule(1, 0.5), seen, 3.4) and _due(StopRule(1, 0.5), seen, 3.5)
    assert _due(StopRule(1, 9.0), [*seen, Seen(3.2, "b", 2)], 3.3)  # the next checkpoint came first: stop now
    assert not _due(StopRule(2, 0.0), seen, 99.0)


def _save(
    folder: Path,
    step: int,
    *,
    lr: float,
    rng_state: bool = True,
    sampler: int = 0,
    world: int = 1,
    python: int | None = None,
) -> None:
    """A checkpoint of ``step``; ``rng_state=False`` zeroes torch's stream, ``python`` sets Python's ``random`` to
    that seed's state (an unseeded stream: another in each run)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    sampler_state = {"epoch": 0, "consumed": sampler, "seed": 0, "num_samples": 8}
    path = dr.save_checkpoint(folder / f"ckpt_{step:08d}.pt", model=model, optimizer=opt, step=step)
    obj = torch.load(path, weights_only=True)
    obj["sampler"] = sampler_state
    obj["meta"]["world_size"] = world
    if not rng_state:
        obj["rng"] = [dict(obj["rng"][0], torch=torch.zeros_like(obj["rng"][0]["torch"]))]
    if python is not None:
        obj["rng"] = [dict(obj["rng"][0], python=random.Random(python).getstate())]
    torch.save(obj, path)


def _first(ev: Evidence) -> PairResult:
    assert ev.first is not None, "the pairs are all equal"
    return ev.first


def _evidence(ref: Path, got: Path, written_by: dict[str, int]) -> tuple[list[PairResult], Evidence]:
    results = [compare_pair(p) for p in pairs_to_compare(ref, got)]
    first = next((r for r in results if not r.equal), None)
    runs = [
        Launch(f"launch {i}", 1.0, -9 if i == 1 else 0, 1.0 if i == 1 else None, (), Path(), Path()) for i in (1, 2)
    ]
    return results, Evidence(results, first, runs, written_by)


def test_pairs_compare_part_by_part_and_the_diagnosis_names_the_cause(tmp_path: Path) -> None:
    ref, got = tmp_path / "ref", tmp_path / "got"
    for folder in (ref, got):
        folder.mkdir()
    for step, lr in ((2, 0.1), (4, 0.05), (6, 0.025)):  # lr moves, and no scheduler is saved
        _save(ref, step, lr=lr)
        _save(got, step, lr=lr if step < 4 else 0.1)  # a relaunch restarted the schedule
    _save(got, 8, lr=0.1)  # and went on past the reference's newest: compared as the newest of each
    results, ev = _evidence(ref, got, {"ckpt_00000004.pt": 2, "ckpt_00000006.pt": 2, "ckpt_00000008.pt": 2})
    assert [(r.pair.step, r.equal) for r in results] == [(2, True), (4, False), (6, False), (None, False)]
    assert [p.part for p in _first(ev).parts] == ["model", "optimizer"] and _first(ev).parts[1].key == "group 0 lr"
    assert [(h.step, h.name, h.reference, h.interrupted) for h in _first(ev).hyperparameters] == [(4, "lr", 0.05, 0.1)]
    causes, text = diagnose(ev)
    assert causes == (Cause.SCHEDULER_NOT_SAVED,) and "lr moves (0.1, 0.05, 0.025" in (text or "")

    shutil.rmtree(got)
    got.mkdir()
    for step in (2, 4, 6):
        _save(got, step, lr={2: 0.1, 4: 0.05, 6: 0.025}[step], rng_state=step < 4, sampler=step)
    results, ev = _evidence(ref, got, {"ckpt_00000002.pt": 1, "ckpt_00000004.pt": 2, "ckpt_00000006.pt": 2})
    assert _first(ev).pair.step == 2 and [p.part for p in _first(ev).parts] == ["data position"]
    # written before any interruption: that alone is the finding, no resume's cause has evidence there
    assert diagnose(ev)[0] == (Cause.NOT_DETERMINISTIC,)
    results, ev = _evidence(ref, got, dict.fromkeys(("ckpt_00000002.pt", "ckpt_00000004.pt"), 2))
    causes, text = diagnose(ev)
    assert causes == (Cause.DATA_POSITION,)  # ahead after a resume, by 2 samples; the reference's never moves
    assert (text or "").startswith("the data position at step 2 (ckpt_00000002.pt, written after a resume) is 2 ")
    for step in (2, 4, 6):
        _save(got, step, lr={2: 0.1, 4: 0.05, 6: 0.025}[step], rng_state=step < 4, world=1 if step < 6 else 2)
    results, ev = _evidence(ref, got, dict.fromkeys(("ckpt_00000002.pt", "ckpt_00000004.pt", "ckpt_00000006.pt"), 2))
    assert _first(ev).pair.step == 4 and [p.part for p in _first(ev).parts] == ["rng"]
    assert diagnose(ev)[0] == (Cause.WORLD_SIZE_CHANGED, Cause.RNG_AFTER_RESUME)


def test_foreign_checkpoints_pair_by_name_and_a_snapshot_without_optimizer_is_named(tmp_path: Path) -> None:
    ref, got = tmp_path / "ref", tmp_path / "got"
    for folder in (ref, got):
        folder.mkdir()
    for folder, scale in ((ref, 1.0), (got, 2.0)):  # PyTorch's DDP tutorial: the model and the epoch, one file
        torch.save({"MODEL_STATE": {"w": torch.ones(3) * scale}, "EPOCHS_RUN": 11}, folder / "snapshot.pt")
    results, ev = _evidence(ref, got, {"snapshot.pt": 2})
    assert [(r.pair.step, r.equal) for r in results] == [(None, False)]
    assert str(_first(ev).parts[0]) == "model w: values differ (max |a-b| = 1.0e+00)"
    assert diagnose(ev)[0] == (Cause.OPTIMIZER_NOT_SAVED,)
    for name in ("epoch_1.pt", "epoch_2.pt"):
        shutil.copy(ref / "snapshot.pt", ref / name)
    (ref / "snapshot.pt").unlink()
    assert [(s, p.name) for s, p in folder_checkpoints(ref)] == [(1, "epoch_1.pt"), (2, "epoch_2.pt")]
    shutil.copy(ref / "epoch_1.pt", ref / "best.pt")
    with pytest.raises(UsageError, match="not one checkpoint, nor checkpoints with a step in their names"):
        folder_checkpoints(ref)


def test_a_result_reads_as_a_report_and_as_json(tmp_path: Path) -> None:
    ref = Launch("reference", 3.0, 0, None, (Seen(2.5, "ckpt_00000003.pt", 3),), tmp_path / "r.out", tmp_path / "r.err")
    stopped = Launch("launch 1", 2.6, -9, 2.6, (Seen(2.5, "ckpt_00000003.pt", 3),), tmp_path / "a", tmp_path / "b")
    check = ResumeCheck(
        ("python", "train.py", "{dir}"),
        True,
        1,
        2,
        "KILL",
        None,
        ((3, True),),
        None,
        (),
        (),
        None,
        ref,
        (stopped,),
        6.0,
        0.1,
    )
    text = check.report()
    assert text.startswith("exact: interrupted 1 time(s)") and "1 of 2 time(s)" in text and "3 =" in text
    data = json.loads(json.dumps(check.as_dict()))
    assert data["schema"] == "dist-resume/check/1" and data["exact"] and data["interrupts"]["at"] == [2.6]
    assert data["wall_seconds"] == {"reference": 3.0, "interrupted": 2.6, "compare": 0.1, "total": 6.0}


def test_inspect_and_load_say_where_sim_tags_come_from(tmp_path: Path) -> None:
    path = tmp_path / "on_sim.pt"
    save_with_device_tag({"model": {"w": torch.ones(2)}}, path, tag="sim:0")
    from dist_resume.cli.inspect import describe_checkpoint

    warnings = describe_checkpoint(path)["warnings"]
    assert any("sim:0 are the test accelerator's" in w and "map_location" in w for w in warnings), warnings
    assert dr.load_checkpoint(path, map_location="cpu")["model"]["w"].device.type == "cpu"
    with pytest.raises(dr.errors.CheckpointError, match="test accelerator's"):
        dr.load_checkpoint(path, map_location={"cuda:0": "cpu"})


def _launcher(mark: str) -> tuple[subprocess.Popen[str], int]:
    """A launcher whose worker runs in a session of its own, as torchrun's do; both carry ``CHECK_MARK=mark``. It
    answers once its worker is up (a process still in exec reads as having no environment yet)."""
    code = (
        "import subprocess, sys, time\n"
        "w = subprocess.Popen([sys.executable, '-c', 'import time; print(1, flush=True); time.sleep(120)'],\n"
        "                     start_new_session=True, stdout=subprocess.PIPE)\n"
        "w.stdout.readline(); print(w.pid, flush=True); time.sleep(120)\n"
    )
    env = {**os.environ, "CHECK_MARK": mark}
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    return proc, int(proc.stdout.readline())  # type: ignore[union-attr]


def test_kill_tree_reaches_workers_in_sessions_of_their_own() -> None:
    mark = f"tree-{os.getpid()}"
    try:
        launcher, worker = _launcher(mark)
        assert sorted(marked_processes("CHECK_MARK", mark)) == sorted([launcher.pid, worker])  # by environment
        os.killpg(launcher.pid, signal.SIGKILL)  # the launcher's group alone: its worker trains on (FACTS 37)
        assert launcher.wait() == -9 and _alive(worker)
        assert kill_tree(worker) == [worker] and _gone(worker)

        launcher, worker = _launcher(mark)
        assert descendants(launcher.pid) == [worker]
        assert kill_tree(launcher.pid) == [launcher.pid, worker]
        assert launcher.wait() == -9 and _gone(worker)
    finally:
        for pid in marked_processes("CHECK_MARK", mark):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pid: int, wait: float = 5.0) -> bool:
    end = time.monotonic() + wait
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return not _alive(pid)


def test_a_relaunch_that_fails_on_what_a_stop_left_is_named(tmp_path: Path) -> None:
    err = tmp_path / "launch-2.err"
    err.write_text(
        "Traceback ...\nRuntimeError: PytorchStreamReader failed reading zip archive: failed finding central directory\n"
    )
    stopped = Launch(
        "launch 1", 3.0, -9, 2.9, (Seen(2.0, "snapshot.pt", None),), tmp_path / "1.out", tmp_path / "1.err"
    )
    failed = Launch("launch 2", 2.5, 1, None, (), tmp_path / "2.out", err)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert folder_checkpoints(empty) == [] and pairs_to_compare(empty, empty) == []
    causes, text = diagnose(Evidence([], None, [stopped, failed], {"snapshot.pt": 1}))
    assert causes == (Cause.RELAUNCH_FAILED,)
    assert "launch 2 (a relaunch after an interruption) failed with exit status 1" in (text or "")
    assert "torch.save is not atomic" in (text or "") and "failed finding central directory" in (text or "")
