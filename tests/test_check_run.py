"""One launch of dist-resume check's COMMAND, without torch in the command: a program that cannot be started, the
checkpoint a run writes as it ends, and the error a torchrun worker raised, shown above torchrun's summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dist_resume.cli.check._launch import Launch, launch, stderr_tail
from dist_resume.cli.check._watch import FolderWatch
from dist_resume.errors import CheckCommandError

# the stderr of `torchrun --standalone --nproc_per_node=2 train.py` whose rank 0 raised RuntimeError (torch 2.x, CPU,
# gloo), trimmed: rank 1 failed after it (its peer was gone), then torchrun's own traceback and failure summary
TORCHRUN_STDERR = """\
[rank0]: Traceback (most recent call last):
[rank0]:   File "train.py", line 5, in <module>
[rank0]:     raise RuntimeError("train.py: the data folder 'no-such-data' does not exist")
[rank0]: RuntimeError: train.py: the data folder 'no-such-data' does not exist
[rank1]: Traceback (most recent call last):
[rank1]:   File "train.py", line 6, in <module>
[rank1]:     dist.barrier()
[rank1]:   File ".../torch/distributed/distributed_c10d.py", line 5356, in barrier
[rank1]:     work.wait()
[rank1]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:19866. This is typically caused by a remote worker crashing.
E1205 09:07:23.841000 21602 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 0 (pid: 21615) of binary: python3
Traceback (most recent call last):
  File ".../bin/torchrun", line 8, in <module>
    sys.exit(main())
  File ".../torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-05_09:07:23
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 21616)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 21616
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-05_09:07:23
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 21615)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
ERROR = "RuntimeError: train.py: the data folder 'no-such-data' does not exist"


def test_a_torchrun_failure_shows_the_workers_error_first(tmp_path: Path) -> None:
    err = tmp_path / "reference.err"
    err.write_text(TORCHRUN_STDERR)
    lines = stderr_tail(err).splitlines()
    assert lines[0] == f"the worker's error (rank 0): {ERROR}"  # the root cause's rank, not rank 1's after it
    assert lines[1:] == TORCHRUN_STDERR.rstrip().splitlines()[-20:]  # then the tail as before
    assert stderr_tail(err, 3).splitlines()[0] == lines[0]  # the diagnosis's three lines of a failed relaunch
    # a torch that prints no [rankN]: prefix: the last exception above the summary, never ChildFailedError
    err.write_text("\n".join(line.partition("[rank0]: ")[2] or line for line in TORCHRUN_STDERR.splitlines()[:4]))
    err.write_text(err.read_text() + "\n" + "\n".join(TORCHRUN_STDERR.splitlines()[10:]))
    assert stderr_tail(err).splitlines()[0] == f"the worker's error: {ERROR}"
    # no torchrun summary: the tail alone, as before
    err.write_text("Traceback (most recent call last):\n  ...\nValueError: bad --lr\n")
    assert stderr_tail(err) == "Traceback (most recent call last):\n  ...\nValueError: bad --lr"


def _launch(tmp_path: Path, argv: list[str], cwd: Path | None = None) -> Launch:
    folder = tmp_path / "ckpt"
    folder.mkdir(exist_ok=True)
    logs = tmp_path / "reference"
    return launch(argv, label="reference", watch=FolderWatch(folder), env={}, cwd=cwd, logs=logs, timeout=30)


def test_a_program_that_cannot_start_is_named_with_the_reason(tmp_path: Path) -> None:
    with pytest.raises(CheckCommandError, match="'pyhton': No such file or directory; check its spelling") as err:
        _launch(tmp_path, ["pyhton", "train.py"])
    assert err.value.run == "reference" and err.value.returncode is None
    assert isinstance(err.value.__cause__, FileNotFoundError)
    script = tmp_path / "train.py"
    script.write_text("#!/usr/bin/env python3\nprint('trained')\n")  # no +x
    with pytest.raises(CheckCommandError, match="Permission denied; make it executable \\(chmod \\+x\\)"):
        _launch(tmp_path, [str(script)])
    script.write_text("print('trained')\n")
    script.chmod(0o755)  # executable, but no #! line
    with pytest.raises(CheckCommandError, match="Exec format error; give the script a #! line"):
        _launch(tmp_path, [str(script)])
    with pytest.raises(CheckCommandError, match=r"its working folder '.*gone': No such file or directory"):
        _launch(tmp_path, [sys.executable, "-c", "pass"], cwd=tmp_path / "gone")


def test_a_checkpoint_written_as_the_run_ends_counts(tmp_path: Path) -> None:
    # HF Trainer's checkpoint-N/ folders count once they stayed the same for SETTLE_S: the last one, written just
    # before the command exits, is still counted (the reference's checkpoints are what the stops are drawn over)
    code = (
        "import pathlib, sys, time\n"
        "for n in (1, 2):\n"
        "    d = pathlib.Path(sys.argv[1]) / f'checkpoint-{n}'\n"
        "    d.mkdir(); (d / 'trainer_state.json').write_text('{}')\n"
        "    time.sleep(0.5 if n == 1 else 0)\n"
    )
    run = _launch(tmp_path, [sys.executable, "-c", code, str(tmp_path / "ckpt")])
    assert run.returncode == 0 and [s.name for s in run.seen] == ["checkpoint-1", "checkpoint-2"]
