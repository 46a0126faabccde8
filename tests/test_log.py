"""What a script with no logging set up sees: one line per resume and per save on stderr, from the library's own
handler on the ``"dist_resume"`` logger; once the application configures logging the lines reach its handlers
alone (no duplicate); ``DIST_RESUME_VERBOSITY`` and ``set_verbosity`` quiet them, warnings stay.

The scripts run in a subprocess: pytest's log capture puts handlers on the root logger, and the library's handler
then stays silent, as it must for any application that configured logging.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dist_resume as dr
from dist_resume._core import log as _log
from dist_resume.errors import UsageError

REPO = Path(__file__).resolve().parents[1]

# a user's script: no logging set up. Prints the epochs its checkpoints record, for the test to compare.
SCRIPT = """
import logging, os, sys
import torch
import dist_resume as dr

quiet_after = os.environ.get("QUIET_AFTER")
model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
os.makedirs("exp1")
torch.save({"model": model.state_dict()}, "exp1/ckpt_00000001.pt")
mgr = dr.CheckpointManager("exp-1", model=model, optimizer=opt, keep_last=3)
assert mgr.resume() is None  # a WARNING (exp1 next to it holds a checkpoint), then "starting fresh"
if os.environ.get("BASIC_CONFIG") == "early":
    logging.basicConfig(format="APP %(levelname)s %(message)s")
sampler = dr.ResumableDistributedSampler(list(range(8)), num_replicas=1, rank=0, shuffle=False)
sampler.set_epoch(2)
mgr.save(1, dataloader=sampler)  # epoch from the data position
if os.environ.get("BASIC_CONFIG") == "late":
    logging.basicConfig(format="APP %(levelname)s %(message)s")
if quiet_after:
    dr.set_verbosity(quiet_after)
mgr.save_async(2, epoch=4).wait()
mgr.save(3)
mgr.close()
again = dr.CheckpointManager("exp-1", model=model, optimizer=opt)
assert again.resume().step == 3
again.close()
dr.save_checkpoint("one.pt", model=model, optimizer=opt, step=7, epoch=1)
assert dr.resume("one.pt", model=model, optimizer=opt).step == 7
dr.CheckpointManager("exp-2", model=model).resume()  # the WARNING (exp-1 holds checkpoints), "starting fresh"
for name in ("exp-1/ckpt_00000001.pt", "exp-1/ckpt_00000002.pt", "one.pt"):
    print(name, torch.load(name, weights_only=True)["meta"]["epoch"])
"""


def _run(folder: Path, **env: str) -> tuple[list[str], str]:
    """The script's stderr lines and its stdout, run in a new subfolder of ``folder``."""
    cwd = folder / f"run{len(list(folder.iterdir()))}"
    cwd.mkdir()
    child = {k: v for k, v in os.environ.items() if not k.startswith("DIST_RESUME")}
    child["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    child.update(OMP_NUM_THREADS="1", **env)
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=cwd, env=child, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr.splitlines(), proc.stdout


def _warning(line: str) -> bool:
    """The near-miss WARNING the script provokes twice (a folder named almost like one that holds checkpoints)."""
    return line.startswith("checkpoint folder ") and "next to it holds checkpoints" in line


def _saved(epochs: str) -> dict[str, str]:
    return dict(line.split() for line in epochs.splitlines())


def test_a_script_without_logging_gets_one_line_per_resume_and_per_save_and_its_warnings(tmp_path: Path) -> None:
    lines, out = _run(tmp_path)
    run, one = tmp_path / "run0/exp-1", tmp_path / "run0/one.pt"
    epochs = _saved(out)
    assert epochs == {"exp-1/ckpt_00000001.pt": "2", "exp-1/ckpt_00000002.pt": "4", "one.pt": "1"}
    info = [line for line in lines if not _warning(line)]
    assert len(info) == 8, lines
    assert info[0] == f"no checkpoint in {run}: starting fresh", info[0]  # the folder as resolved
    # the epoch each line names is the one its checkpoint records; sizes from the bytes written
    for line, (name, details) in zip(
        info[1:4],
        [
            ("ckpt_00000001.pt", f"(step 1, epoch {epochs['exp-1/ckpt_00000001.pt']}, "),
            ("ckpt_00000002.pt", f"(step 2, epoch {epochs['exp-1/ckpt_00000002.pt']}, "),
            ("ckpt_00000003.pt", "(step 3, "),
        ],
    ):
        assert line.startswith(f"saved {run / name} {details}"), line
        assert line.endswith(" s") or line.endswith(" s, in the background"), line
        assert f"{(run / name).stat().st_size / 1024:.1f} KiB) in " in line, line
    assert "in the background" in info[2] and "in the background" not in info[1] + info[3]
    assert info[4].startswith(f"resumed from {run / 'ckpt_00000003.pt'} at step 3 in "), info[4]
    assert info[4].endswith(" s (restored model, optimizer, rng)"), info[4]
    assert info[5].startswith(f"saved {one} (step 7, epoch 1, {one.stat().st_size / 1024:.1f} KiB) in ")
    assert info[6].startswith(f"resumed from {one} at step 7 (epoch 1) in "), info[6]
    assert sum(map(_warning, lines)) == 2, lines
    assert info[7] == f"no checkpoint in {tmp_path / 'run0/exp-2'}: starting fresh", info[7]


@pytest.mark.parametrize("when", ["early", "late"])
def test_after_logging_basicconfig_each_line_comes_once_through_the_applications_handler(
    tmp_path: Path, when: str
) -> None:
    lines, _ = _run(tmp_path, BASIC_CONFIG=when)
    app = [line for line in lines if line.startswith("APP ")]
    ours = [line for line in lines if not line.startswith("APP ")]  # the library's handler: the message alone
    assert len(lines) == 10, lines  # 8 lines, 2 warnings: each once
    if when == "early":  # configured before the first save: only the start's two lines were the library's
        assert len(ours) == 2 and ours[1].endswith("exp-1: starting fresh"), lines
    else:  # configured after the first save
        assert len(ours) == 3 and ours[2].startswith("saved "), lines
    assert sum(line.startswith("APP INFO saved ") for line in app) == (4 if when == "early" else 3), lines
    assert sum(line.startswith("APP INFO resumed from ") for line in app) == 2, lines
    assert sum(line.startswith("APP WARNING checkpoint folder ") for line in app) == 1, lines


@pytest.mark.slow
def test_the_environment_variable_and_set_verbosity_quiet_the_lines_and_warnings_stay(tmp_path: Path) -> None:
    lines, _ = _run(tmp_path, DIST_RESUME_VERBOSITY="warning")
    assert len(lines) == 2 and all(map(_warning, lines)), lines
    lines, _ = _run(tmp_path, QUIET_AFTER="error")
    assert _warning(lines[0]) and [line.split(" ")[0] for line in lines[1:]] == ["no", "saved"], lines  # no 2nd warning
    lines, _ = _run(tmp_path, DIST_RESUME_VERBOSITY="Loud")
    assert lines[0] == "DIST_RESUME_VERBOSITY='loud' is not one of debug, info, warning, error: using info"
    assert len(lines) == 1 + 10, lines  # and the default: every line


def test_set_verbosity_sets_the_library_loggers_level_and_refuses_other_names() -> None:
    logger = logging.getLogger("dist_resume")
    before = logger.level
    try:
        for name, level in (("debug", logging.DEBUG), ("WARNING", logging.WARNING), (logging.ERROR, logging.ERROR)):
            dr.set_verbosity(name)
            assert logger.level == level
        for bad in ("loud", 15, True, None):
            with pytest.raises(UsageError, match="set_verbosity"):
                dr.set_verbosity(bad)  # type: ignore[arg-type]
    finally:
        logger.setLevel(before)
    assert logging.getLogger().level == logging.getLogger().level  # the root logger is never touched
    assert sum(isinstance(h, _log._UnconfiguredHandler) for h in logger.handlers) == 1


def test_the_librarys_handler_stays_silent_while_another_handler_would_get_the_record(
    capsys: pytest.CaptureFixture[str],
) -> None:
    (own,) = [h for h in logging.getLogger("dist_resume").handlers if isinstance(h, _log._UnconfiguredHandler)]
    record = logging.LogRecord("dist_resume", logging.INFO, __file__, 1, "saved x", None, None)
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers.clear()  # as in a script that configured nothing (restored below: pytest's own capture)
    try:
        own.handle(record)
        assert capsys.readouterr().err == "saved x\n"
        root.handlers.append(logging.NullHandler())
        own.handle(record)
        assert capsys.readouterr().err == ""
    finally:
        root.handlers[:] = saved


def test_a_save_line_names_the_size_of_what_was_written_and_a_rank_other_than_0_says_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        path = dr.save_checkpoint(tmp_path / "a.pt", model=torch.nn.Linear(2, 2), step=1)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"saved {tmp_path / 'a.pt'} (step 1, {path.stat().st_size / 1024:.1f} KiB) in ")
    assert _log.shown_size(512) == "512 B" and _log.shown_size(3 * 1024**3) == "3.0 GiB"
    assert _log.shown_size(None) == "size unknown"
    caplog.clear()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with caplog.at_level(logging.INFO, logger="dist_resume"):
        _log.log_saved(path, step=1, epoch=None, size=1, seconds=0.0)
    assert caplog.records == []
