"""dist-resume check's verdict on two runs' folders, without launching a training run: when a resume checked nothing,
and Python's and NumPy's streams left unseeded (exact, with a note) told apart from a restore that went wrong. The
checkpoints are written as tests/test_check_parts.py writes them; the command itself: tests/test_check_cli.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_resume.cli.check._compare import UNSEEDED_PART, unseeded_said
from dist_resume.cli.check._launch import Launch, Seen
from dist_resume.cli.check._result import Cause, ResumeCheck
from dist_resume.cli.check._verdict import verdict
from dist_resume.errors import CheckCommandError
from tests.test_check_parts import _save

STEPS = (2, 4, 6)


def _name(step: int) -> str:
    return f"ckpt_{step:08d}.pt"


def _runs(tmp_path: Path, by_launch_1: tuple[int, ...]) -> tuple[Launch, list[Launch]]:
    """The reference, and an interrupted run stopped once: launch 1 wrote ``by_launch_1``, launch 2 the rest."""
    ref = Launch("reference", 3.0, 0, None, tuple(Seen(1.0 + s, _name(s), s) for s in STEPS), Path(), Path())
    out, err = tmp_path / "launch-2.out", tmp_path / "launch-2.err"
    out.write_text("")
    err.write_text("train.py: resumed at step 6 of 6, nothing left to do\n")
    first = Launch("launch 1", 2.5, -9, 2.5, tuple(Seen(1.0 + s, _name(s), s) for s in by_launch_1), Path(), Path())
    rest = tuple(Seen(1.0, _name(s), s) for s in STEPS if s not in by_launch_1)
    return ref, [first, Launch("launch 2", 1.5, 0, None, rest, out, err)]


def _folders(
    tmp_path: Path, *, ref: dict[int, int] | None = None, got: dict[int, int] | None = None
) -> tuple[Path, Path]:
    """Both runs' folders, equal but for the Python stream each step's checkpoint holds (``{step: seed}``)."""
    folders = (tmp_path / "reference", tmp_path / "interrupted")
    for folder, python in zip(folders, (ref or {}, got or {})):
        folder.mkdir()
        for step in STEPS:
            _save(folder, step, lr=0.1, python=python.get(step))
    return folders


def _verdict(
    tmp_path: Path, folders: tuple[Path, Path], by_launch_1: tuple[int, ...], *, strict_extra: bool = False
) -> ResumeCheck:
    ref, launches = _runs(tmp_path, by_launch_1)
    argv = ["python", "train.py", "{dir}"]
    return verdict(argv, ref, launches, folders, asked=1, signal="KILL", strict_extra=strict_extra)


def test_a_run_whose_relaunch_wrote_nothing_checked_nothing(tmp_path: Path) -> None:
    # launch 1 wrote every checkpoint before its stop; launch 2 resumed at the end and saved nothing more: the pairs
    # are equal, but none was written after a resume
    folders = _folders(tmp_path)
    with pytest.raises(CheckCommandError, match="no checkpoint was written after a resume: nothing was checked") as err:
        _verdict(tmp_path, folders, by_launch_1=STEPS)
    assert "ckpt_00000002.pt, ckpt_00000004.pt, ckpt_00000006.pt" in str(err.value) and "more often" in str(err.value)
    assert err.value.run == "launch 2" and "nothing left to do" in err.value.stderr
    # one written after the resume: exact, as before
    assert _verdict(tmp_path, folders, by_launch_1=(2, 4)).exact


def test_launch_1_checkpoints_that_differ_stay_not_deterministic(tmp_path: Path) -> None:
    folders = (tmp_path / "reference", tmp_path / "interrupted")
    for folder, lr in zip(folders, (0.1, 0.2)):
        folder.mkdir()
        for step in STEPS:
            _save(folder, step, lr=lr)
    check = _verdict(tmp_path, folders, by_launch_1=STEPS)  # nothing after a resume, but a difference before it
    assert not check.exact and check.causes[0] is Cause.NOT_DETERMINISTIC
    assert check.first_difference is not None and check.first_difference.written_by == 1


def test_an_unseeded_python_stream_alone_is_exact_with_a_note(tmp_path: Path) -> None:
    # a script that seeds only torch: its Python stream comes from the OS's entropy, another in each process, and is
    # restored on resume, so it differs at every step, before the stop and after it; all else is equal
    folders = _folders(tmp_path, ref=dict.fromkeys(STEPS, 1), got=dict.fromkeys(STEPS, 2))
    check = _verdict(tmp_path, folders, by_launch_1=(2,))
    assert check.exact and check.first_difference is None and check.causes == () and check.diagnosis is None
    assert check.steps == ((2, True), (4, True), (6, True))
    (note,) = check.notes
    assert (
        note.startswith("Python's `random` differs between the two runs at every step compared") and "NumPy" not in note
    )
    assert "does not seed it" in note and "dist_resume.seed_rng(seed), or random.seed(seed)" in note
    assert f"  note         {note}" in check.report() and check.report().startswith("exact:")
    assert json.loads(json.dumps(check.as_dict()))["notes"] == [note]
    both = (name for name in ("numpy", "python"))  # as the verdict gives them: once through
    assert unseeded_said(both) == (
        "Python's `random` and NumPy's global stream",
        False,
        "random.seed(seed) and numpy.random.seed(seed)",
    )


def test_a_python_stream_that_differs_only_after_a_resume_is_a_difference(tmp_path: Path) -> None:
    # equal at the checkpoint written before the stop, different after it: restored wrongly, not unseeded
    folders = _folders(tmp_path, ref=dict.fromkeys(STEPS, 1), got={2: 1, 4: 2, 6: 2})
    check = _verdict(tmp_path, folders, by_launch_1=(2,))
    assert not check.exact and check.notes == ()
    first = check.first_difference
    assert first is not None and first.step == 4 and first.written_by == 2
    assert [(p.part, p.key) for p in first.parts] == [(UNSEEDED_PART, "python")]
    assert check.causes == (Cause.RNG_AFTER_RESUME,) and "written after a resume" in (check.diagnosis or "")
    assert check.steps == ((2, True), (4, False), (6, False))


def test_an_unseeded_stream_with_another_difference_is_named_with_it(tmp_path: Path) -> None:
    # unseeded (different at every step) and torch's stream lost after the resume: not exact; the diagnosis names
    # both, the second from the first step where more than the unseeded streams differ
    folders = _folders(tmp_path, ref=dict.fromkeys(STEPS, 1), got=dict.fromkeys(STEPS, 2))
    _save(folders[1], 6, lr=0.1, python=2, rng_state=False)
    check = _verdict(tmp_path, folders, by_launch_1=(2,))
    assert not check.exact and check.notes == ()
    assert check.first_difference is not None and check.first_difference.step == 2  # the first that differs at all
    assert check.causes == (Cause.RNG_NOT_SEEDED, Cause.RNG_AFTER_RESUME)
    lines = (check.diagnosis or "").splitlines()
    assert lines[0].startswith("Python's `random` differs already at ckpt_00000002.pt, written before the first")
    assert "does not seed it" in lines[0] and "random.seed(seed)" in lines[0] and "numpy" not in lines[0]
    assert lines[1].startswith("the RNG streams differ at step 6 (ckpt_00000006.pt, written after a resume): rank 0's")
    assert "torch stream is not the reference's within 65,536 draws either way" in lines[1]  # zeroed: not one stream
    assert "they were not restored" in lines[1] and "Python" not in lines[1]  # unseeded: not evidence of a restore
