"""``dist-resume check`` as users run it: ``dist-resume check [options] -- COMMAND ... {dir}`` in a shell, and
``dist_resume.testing.check_resume`` in a pytest test. The training scripts are written as users write them
(tests/check_scripts/): a correct one, the same with one mistake planted, and PyTorch's DDP tutorial.

Each run of a one-process script costs ~3 s here (a fresh interpreter importing torch), so the cases that only need
one interruption ask for one. CI runs one whole check (the mistakes named, in a test); the others, each three
launches, run with ``-m slow`` (docs/testing.md lists them), and .ci/run checks launch/train.py under torchrun on the
test accelerator (scripts/ci_multigpu.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume.testing
from dist_resume.errors import CheckCommandError
from dist_resume.testing import Cause

REPO = Path(__file__).resolve().parents[1]
TRAIN = str(REPO / "tests" / "check_scripts" / "train.py")
TUTORIAL = str(REPO / "tests" / "check_scripts" / "ddp_tutorial.py")
RUN_TIMEOUT = "60"  # seconds per run of a one-process script: under pytest's 240 for the whole check


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("dist-resume")  # the console script pip installed next to python
    return [str(script)] if script.is_file() else [sys.executable, "-m", "dist_resume"]


def check(tmp_path: Path, *args: str, timeout: float = 230) -> subprocess.CompletedProcess[str]:
    """``dist-resume check *args`` in a shell in ``tmp_path``; the check's folders go to ``tmp_path`` (TMPDIR)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    return subprocess.run(
        [*_cli(), "check", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout
    )


def _json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert done.returncode in (0, 1), done.stdout + done.stderr
    return dict(json.loads(done.stdout))


def _leftovers(tmp_path: Path) -> list[str]:
    """Processes still running a command of this test (their command line names a folder under ``tmp_path``)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if str(tmp_path) in text:
            found.append(f"{cmdline.parent.name}: {text}")
    return found


def test_a_command_without_dir_is_a_usage_error(tmp_path: Path) -> None:
    done = check(tmp_path, "--", sys.executable, TRAIN, "ckpts")
    assert done.returncode == 2 and done.stdout == ""
    assert "dist-resume check: error: COMMAND has no {dir}" in done.stderr and "--ckpt-dir {dir}" in done.stderr
    done = check(tmp_path, "--interrupts", "1", "--")
    assert done.returncode == 2 and "no COMMAND to check" in done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing was run, no folder made


def test_a_command_that_fails_on_its_own_is_exit_2_with_its_error(tmp_path: Path) -> None:
    done = check(tmp_path, "--timeout", RUN_TIMEOUT, "--", sys.executable, TRAIN, "{dir}", "--bug", "fail")
    assert done.returncode == 2 and done.stdout == ""
    assert "COMMAND failed on its own: the reference run exited with status 1" in done.stderr
    assert "  | train.py: the data folder 'no-such-data' does not exist" in done.stderr  # its own last lines
    assert list(tmp_path.iterdir()) == []  # the check's folders are gone


def test_no_checkpoint_and_a_run_past_its_timeout_are_exit_2(tmp_path: Path) -> None:
    # commands without torch: each run costs a Python start-up
    done = check(tmp_path, "--", sys.executable, "-c", "import sys; print('trained, saved nothing')", "{dir}")
    assert (
        done.returncode == 2
        and "no checkpoint appeared in {dir} (it is empty): nothing could be interrupted" in done.stderr
    )
    assert "  | trained, saved nothing" in done.stderr  # its last lines (stdout, when stderr is empty)
    sleeper = "import sys, time; print('loading data...', file=sys.stderr, flush=True); time.sleep(60)"
    done = check(tmp_path, "--timeout", "1", "--", sys.executable, "-c", sleeper, "{dir}")
    assert done.returncode == 2 and "the reference run did not end within --timeout 1 s; it was killed" in done.stderr
    assert "  | loading data..." in done.stderr
    assert _leftovers(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_a_command_that_cannot_start_is_exit_2(tmp_path: Path) -> None:
    # a misspelt program, and a script without +x: said with the OS's reason and what to do, not a traceback
    done = check(tmp_path, "--", "pyhton", "train.py", "{dir}")
    assert done.returncode == 2 and done.stdout == "" and "Traceback" not in done.stderr
    assert "error: COMMAND could not be started for the reference run: 'pyhton': No such file or directory" in (
        done.stderr
    )
    assert "check its spelling and that it is on PATH" in done.stderr
    (tmp_path / "train.py").write_text("#!/usr/bin/env python3\nprint('trained')\n")
    done = check(tmp_path, "--", "./train.py", "{dir}")
    assert done.returncode == 2 and "'./train.py': Permission denied; make it executable (chmod +x)" in done.stderr
    with pytest.raises(CheckCommandError, match="could not be started for the reference run: 'pyhton'") as err:
        dist_resume.testing.check_resume(["pyhton", "train.py", "{dir}"])
    assert err.value.run == "reference"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]  # the check's folders are gone


def test_a_command_that_saves_only_at_its_end_is_exit_2(tmp_path: Path) -> None:
    # one checkpoint: a stop after it leaves nothing for a relaunch to save, so nothing would be checked
    args = ("--timeout", RUN_TIMEOUT, "--", sys.executable, TRAIN, "{dir}", "--save-every", "32", "--steps", "32")
    done = check(tmp_path, *args)
    assert done.returncode == 2 and done.stdout == "", done.stderr
    assert "error: the reference run wrote only one checkpoint (ckpt_00000032.pt, at " in done.stderr
    assert "Save during the run more often (every N steps, or each epoch)" in done.stderr
    assert not list(tmp_path.glob("dist-resume-check.*"))  # the check's folders are gone (torch may leave a cache)


@pytest.mark.slow
def test_a_correct_script_resumes_exactly(tmp_path: Path) -> None:
    # seeded as most scripts are, torch alone: Python's and NumPy's streams differ between the runs (OS entropy), and
    # nothing it trains draws from them: exact, with a note. It saves its arguments in extra (as nanoGPT's config and
    # torchvision's args), its checkpoint folder among them, another in each run: compared as <run folder>, said
    train = (sys.executable, TRAIN, "{dir}", "--torch-seed-only", "--save-args")
    args = ("--json", "--keep", "--interrupts", "1", "--timeout", RUN_TIMEOUT, "--", *train)
    done = check(tmp_path, *args)
    result = _json(done)
    assert done.returncode == 0 and result["exact"] is True, done.stdout
    assert result["schema"] == "dist-resume/check/1" and result["causes"] == [] and result["diagnosis"] is None
    note, masked = result["notes"]
    assert masked == (
        "2 saved strings named the run's folder (extra ['args']['ckpt'], extra ['log_file']), another in each run; "
        "compared with it replaced by <run folder>"
    )
    if importlib.util.find_spec("numpy") is not None:  # rng_state_dict saves NumPy's stream where it is installed
        assert note.startswith("Python's `random` and NumPy's global stream differ between the two runs at every step")
        assert "the command does not seed them" in note and "numpy.random.seed(seed)" in note
    assert note.startswith("Python's `random`") and "dist_resume.seed_rng(seed), or random.seed(seed)" in note
    stopped_at = result["launches"][0]["stopped_at"]
    assert result["interrupts"] == {"asked": 1, "done": 1, "signal": "KILL", "at": [stopped_at]}
    assert [launch["returncode"] for launch in result["launches"]] == [-9, 0]  # SIGKILLed, then ran to its end
    # the newest checkpoint and every earlier step both folders still hold (keep_last=4), all equal
    assert [s["step"] for s in result["steps"]] == [20, 24, 28, 32] and all(s["equal"] for s in result["steps"])
    ref, got = Path(result["folders"]["reference"]), Path(result["folders"]["interrupted"])
    assert ref.parent.parent == got.parent.parent == tmp_path  # --keep: both folders, in TMPDIR
    assert sorted(p.name for p in got.glob("ckpt_*")) == [f"ckpt_{s:08d}.pt" for s in (20, 24, 28, 32)]
    saved = torch.load(got / "ckpt_00000032.pt", weights_only=True)["extra"]
    assert saved["args"]["ckpt"] == str(got) and saved["log_file"] == str(got / "train.log")  # each run's own
    walls = result["wall_seconds"]
    assert walls["total"] >= walls["reference"] + walls["interrupted"] and walls["compare"] < walls["reference"]
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_a_script_that_snapshots_every_step_resumes_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a snapshot into shared memory every step, a save every 8: killed between saves, the relaunch resumes from its
    # newest snapshot (or from the folder when the kill came right after a save), and the run stays exact; the
    # snapshots are gone once the run closed (DIST_RESUME_SHM_DIR: this test's own shared-memory folder)
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setenv("DIST_RESUME_SHM_DIR", str(shm))
    train = (sys.executable, TRAIN, "{dir}", "--snapshot-every", "1", "--save-every", "8")
    done = check(tmp_path, "--json", "--keep", "--interrupts", "1", "--timeout", RUN_TIMEOUT, "--", *train)
    result = _json(done)
    assert done.returncode == 0 and result["exact"] is True, done.stdout
    assert [launch["returncode"] for launch in result["launches"]] == [-9, 0]
    resumed = (Path(result["folders"]["interrupted"]).parent / "interrupted-launch-2.err").read_text()
    assert resumed.startswith("resumed from "), resumed
    from_memory = str(shm) in resumed.splitlines()[0]
    step = int(resumed.split(" at step ")[1].split()[0])
    assert from_memory or step % 8 == 0, resumed  # a snapshot's step, or a save's when the kill followed one
    assert list(shm.iterdir()) == [] and _leftovers(tmp_path) == []


@pytest.mark.slow
def test_pytorchs_ddp_tutorial_is_found_and_named(tmp_path: Path) -> None:
    args = ("--json", "--interrupts", "1", "--timeout", RUN_TIMEOUT, "--", sys.executable, TUTORIAL, "{dir}")
    result = _json(check(tmp_path, *args))
    assert result["exact"] is False
    assert result["steps"] == [{"step": None, "equal": False}]  # one snapshot.pt, overwritten each epoch
    first = result["first_difference"]
    assert first["reference"] == first["interrupted"] == "snapshot.pt" and first["written_by_launch"] == 2
    assert [p["part"] for p in first["parts"]] == ["model"] and "max |a-b|" in first["parts"][0]["problem"]
    assert result["causes"] == ["optimizer-not-saved"] and "PyTorch's DDP tutorial" in result["diagnosis"]


@pytest.mark.e2e
def test_check_resume_in_a_test_names_each_mistake() -> None:
    # the case, a DataLoader as PyTorch's tutorial writes it (no generator=) of which only the sampler is
    # registered, and a scheduler left out of the CheckpointManager: one check names both
    bugs = ["--bug", "generator", "--bug", "scheduler", "--save-every", "5", "--steps", "30"]  # resumed mid-epoch
    check = dist_resume.testing.check_resume([sys.executable, TRAIN, "{dir}", *bugs], interrupts=1, timeout=60)
    assert not check.exact and check.interrupts == 1
    assert check.first_difference is not None and check.first_difference.written_by == 2
    assert {"model", "optimizer", "rng"} <= {p.part for p in check.first_difference.parts}
    assert check.causes == (Cause.SCHEDULER_NOT_SAVED, Cause.RNG_AFTER_RESUME)
    assert "pass the DataLoader as dataloader=" in (check.diagnosis or "") and "scheduler=sched" in (
        check.diagnosis or ""
    )
    assert any(h.name == "lr" for h in check.hyperparameters)
    assert check.report().startswith("different:") and check.folders is None
    fails = "import sys; sys.exit('train.py: the data folder does not exist')"  # no torch: a Python start-up
    with pytest.raises(CheckCommandError, match="failed on its own") as failed:
        dist_resume.testing.check_resume([sys.executable, "-c", fails, "{dir}"], timeout=60)
    assert failed.value.run == "reference" and failed.value.returncode == 1 and "does not exist" in failed.value.stderr


@pytest.mark.slow
def test_a_batch_held_across_the_save_is_named_with_its_evidence() -> None:
    # the next step's batch drawn before the save (as nanoGPT's loop prefetches it): the saved position counts it, and
    # the resumed run skips it. Its RNG streams are restored and equal: nothing shows them as a cause
    train = [sys.executable, TRAIN, "{dir}", "--bug", "held-batch"]
    check = dist_resume.testing.check_resume(train, interrupts=1, timeout=60)
    assert not check.exact and check.causes == (Cause.BATCH_HELD,), check.report()
    first = check.first_difference
    assert first is not None and first.written_by == 2 and first.step is not None
    assert {"model", "data position"} <= {p.part for p in first.parts} and "rng" not in {p.part for p in first.parts}
    text = check.diagnosis or ""
    assert text.startswith(
        f"the data position at step {first.step} ({first.interrupted}, written after a resume) is "
        "8 samples ahead of the reference's"
    )
    assert "8 samples a step in the reference" in text and "one step's worth: a batch drawn before the save" in text
    for unfounded in ("RNG", "generator=", "not restored", "register the DataLoader", "workers"):
        assert unfounded not in text, unfounded


@pytest.mark.slow
def test_a_loader_whose_position_counts_prefetched_batches_is_named_from_what_its_checkpoints_record() -> None:
    # torchvision's detection loader: workers, no generator=, a batch sampler of its own that no save can count. Its
    # checkpoints record that the position counts the prefetched batches (with the first save's WARNING): the cause
    # is the data position, with that WARNING's fixes, whatever else follows from it
    train = [sys.executable, TRAIN, "{dir}", "--bug", "prefetch", "--save-every", "5", "--steps", "30"]  # mid-epoch
    check = dist_resume.testing.check_resume(train, interrupts=1, timeout=60)
    assert not check.exact and check.causes == (Cause.DATA_POSITION,), check.report()
    first = check.first_difference
    assert first is not None and first.written_by == 2 and "data position" in {p.part for p in first.parts}
    text = check.diagnosis or ""
    assert "the checkpoints record that it counts the batches a DataLoader's 2 worker(s) prefetched (2 each)" in text
    assert "(the WARNING its first save logged: " in text and "BatchSampler" in text  # its fixes, for this loader
    for unfounded in ("RNG streams differ", "generator=", "persistent_workers", "held in a variable"):
        assert unfounded not in text, unfounded


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(420)
def test_an_evaluation_on_rank_0_between_a_save_and_the_next_step_is_named(tmp_path: Path) -> None:
    # rank 0 evaluates on a random subset right after each save, drawing from its own stream; a relaunch resumes after
    # the save: rank 0's stream is behind, rank 1's equal, at the first checkpoint written after the resume
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = ("--json", "--interrupts", "1", "--timeout", "120", "--", *torchrun, TRAIN, "{dir}", "--bug", "eval-rank0")
    result = _json(check(tmp_path, *args, timeout=400))
    assert result["exact"] is False and result["causes"] == ["draws-on-some-ranks"], result["diagnosis"]
    first = result["first_difference"]
    assert first["written_by_launch"] == 2 and "rng" in {p["part"] for p in first["parts"]}
    text = result["diagnosis"]
    assert f"the RNG streams differ at step {first['step']} ({first['interrupted']}, written after a resume): " in text
    assert "rank 0's torch stream is " in text and " behind the reference's, while the streams of rank 1 are equal" in (
        text
    )
    assert "not restored" not in text and "generator=" not in text
    assert _leftovers(tmp_path) == []


@pytest.mark.slow
def test_an_unregistered_scheduler_is_found_and_named(tmp_path: Path) -> None:
    args = ("--interrupts", "1", "--timeout", RUN_TIMEOUT, "--", sys.executable, TRAIN, "{dir}", "--bug", "scheduler")
    done = check(tmp_path, *args)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    assert out.startswith("different: the interrupted run does not end as the uninterrupted one")
    assert "first difference at step" in out and "optimizer group 0 lr: A float" in out
    assert "hyperparameters that differ (reference -> interrupted):" in out and " lr: " in out
    assert "diagnosis    the checkpoints hold no LR scheduler, but lr moves" in out and "scheduler=sched" in out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("bug", "cause"), [("rng", "rng-after-resume"), ("sampler", "data-position-not-saved")], ids=["rng-off", "sampler"]
)
def test_rng_restore_off_and_an_unregistered_sampler_are_found(tmp_path: Path, bug: str, cause: str) -> None:
    args = ("--json", "--interrupts", "1", "--timeout", RUN_TIMEOUT, "--", sys.executable, TRAIN, "{dir}", "--bug", bug)
    result = _json(check(tmp_path, *args))
    assert result["exact"] is False and result["causes"] == [cause], result["diagnosis"]


@pytest.mark.slow
def test_a_graceful_stop_and_the_test_accelerator(tmp_path: Path, sim_worker_env: dict[str, str]) -> None:
    # --device sim boots every Python process of the command on sim:LOCAL_RANK; --signal TERM stops it gracefully
    env = {**os.environ, "TMPDIR": str(tmp_path), **sim_worker_env}
    args = ["--json", "--keep", "--device", "sim", "--signal", "TERM", "--interrupts", "1", "--timeout", RUN_TIMEOUT]
    done = subprocess.run(
        [*_cli(), "check", *args, "--", sys.executable, TRAIN, "{dir}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=230,
    )
    result = _json(done)
    assert result["exact"] and result["device"] == "sim" and result["interrupts"]["signal"] == "TERM"
    assert result["launches"][0]["returncode"] == -15  # Python's default SIGTERM: the process ends there
    from dist_resume.cli.inspect import describe_checkpoint

    newest = sorted(Path(result["folders"]["interrupted"]).glob("ckpt_*"))[-1]
    assert "sim:0" in describe_checkpoint(newest)["device_tags"]  # it trained on the test accelerator


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(420)
def test_launch_train_py_under_torchrun_resumes_exactly(tmp_path: Path) -> None:
    """The project's own launch flow on 2 CPU ranks, with one stop (CI runs it with two, the default, on the test
    accelerator: scripts/ci_multigpu.sh): torchrun's workers run in sessions of their own and are stopped with it."""
    train = [
        *("--steps", "120", "--save-every", "20", "--num-samples", "128", "--batch-size", "16"),
        *("--log-every", "40", "--timeout", "60", "--ckpt-dir", "{dir}"),
    ]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = ("--json", "--interrupts", "1", "--timeout", "120", "--", *torchrun, str(REPO / "launch" / "train.py"))
    result = _json(check(tmp_path, *args, *train, timeout=400))
    assert result["exact"] is True and result["interrupts"]["done"] == 1
    assert [s["step"] for s in result["steps"]] == [80, 100, 120]  # keep_last=3
    assert [launch["returncode"] for launch in result["launches"]] == [-9, 0]  # the whole tree SIGKILLed, then done
    assert _leftovers(tmp_path) == []  # the agents and every worker of every launch
