"""dist-resume check's diagnosis names a cause only with its evidence (the part, the step, the numbers that show it),
and says "no known cause fits" where none does. Checkpoints are built with the RNG streams and data positions the
known mistakes leave, without launching a training run; the scripts that make them: tests/test_check_cli.py."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume.cli.check._result import Cause, ResumeCheck
from dist_resume.cli.check._streams import WORDS, rank_streams
from tests.test_check_verdict import STEPS, _verdict


def _stream(draws: int) -> torch.Tensor:
    """torch's CPU stream seeded with 5, after ``draws`` 32-bit draws."""
    g = torch.Generator().manual_seed(5)
    if draws:
        torch.empty(draws, dtype=torch.int32).random_(generator=g)
    return g.get_state()


def _rank(draws: int, rank: int = 0) -> dict[str, Any]:
    return {
        "python": random.Random(rank).getstate(),
        "torch": _stream(draws + 100 * rank),
        "device": None,
        "numpy": None,
        "seed": 0,
    }


def _save(folder: Path, step: int, *, rng: Sequence[dict[str, Any]] | None, moved: bool, **more: Any) -> None:
    """A checkpoint of ``step`` with these RNG streams (a list, index = rank; None: none saved) and parts; ``moved``
    changes its model (the training went another way)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight.add_(0.5 if moved else 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    path = dr.save_checkpoint(
        folder / f"ckpt_{step:08d}.pt", model=model, optimizer=opt, step=step, rng=rng is not None
    )
    obj = torch.load(path, weights_only=True)
    if rng is not None:
        obj["rng"] = list(rng)
        obj["meta"]["world_size"] = len(rng)
    obj["meta"].update(more.pop("meta", {}))  # what a save records about the run (dist_resume/_save/evidence.py)
    obj.update(more)
    torch.save(obj, path)


def _check(
    tmp_path: Path,
    ref: dict[int, dict[str, Any]],
    got: dict[int, dict[str, Any]],
    *,
    by_launch_1: tuple[int, ...] = (2,),
    strict_extra: bool = False,
) -> ResumeCheck:
    """Both runs' folders (``{step: _save keywords}``), launch 1 wrote ``by_launch_1`` and a relaunch the rest: the
    verdict."""
    folders = (tmp_path / "reference", tmp_path / "interrupted")
    for folder, steps in zip(folders, (ref, got)):
        folder.mkdir()
        for step in STEPS:
            _save(folder, step, **dict(steps[step]))
    return _verdict(tmp_path, folders, by_launch_1=by_launch_1, strict_extra=strict_extra)


def _ranks(*draws: int) -> list[dict[str, Any]]:
    return [_rank(n, rank) for rank, n in enumerate(draws)]


def _rng_case(tmp_path: Path, ref: tuple[int, ...], got: tuple[int, ...]) -> ResumeCheck:
    """Equal at step 2; from step 4 on, each rank's torch stream ``got[r] - ref[r]`` draws apart, the model moved."""
    same = {"rng": _ranks(*ref), "moved": False}
    return _check(
        tmp_path,
        {2: same, 4: same, 6: same},
        {2: same, 4: {"rng": _ranks(*got), "moved": True}, 6: {"rng": _ranks(*got), "moved": True}},
    )


def test_a_batch_drawn_from_the_rng_ahead_of_the_save_is_named_by_its_draws(tmp_path: Path) -> None:
    # nanoGPT's loop: the next batch's indices are drawn (torch.randint, 8 draws) before the save; a relaunch draws
    # another batch from the restored streams: 8 draws ahead, on every rank
    check = _rng_case(tmp_path, (40, 40), (48, 48))
    assert not check.exact and check.causes == (Cause.BATCH_HELD,), check.diagnosis
    text = check.diagnosis or ""
    assert text.startswith(
        "the RNG streams differ at step 4 (ckpt_00000004.pt, written after a resume): rank 0's "
        "torch stream is 8 draws (32-bit) ahead of the reference's, rank 1's torch stream is 8 "
    )
    assert "a batch drawn from the RNG ahead of the save and held in a variable" in text
    assert "not restored" not in text and "generator=" not in text  # no evidence for either


def test_an_evaluation_on_rank_0_after_the_save_is_named_by_the_ranks_it_touched(tmp_path: Path) -> None:
    # rank 0 evaluates between a save and the next step, drawing 40 times; a relaunch resumes after the save and does
    # not: rank 0's stream is 40 draws behind, rank 1's equal
    check = _rng_case(tmp_path, (40, 40), (0, 40))
    assert check.causes == (Cause.DRAWS_ON_SOME_RANKS,), check.diagnosis
    text = check.diagnosis or ""
    assert (
        "rank 0's torch stream is 40 draws (32-bit) behind the reference's, while the streams of rank 1 are equal"
        in (text)
    )
    assert "on some ranks only between a save and the next step (an evaluation on rank 0)" in text
    assert "torch.random.fork_rng()" in text and "not restored" not in text and "generator=" not in text


def test_one_64_bit_draw_more_is_a_new_dataloader_iterator_and_unrelated_streams_were_not_restored(
    tmp_path: Path,
) -> None:
    check = _rng_case(tmp_path, (40, 40), (42, 42))
    assert check.causes == (Cause.RNG_AFTER_RESUME,)
    assert "one 64-bit draw more, on every rank: what a DataLoader without generator= draws" in (check.diagnosis or "")
    assert "not restored" not in (check.diagnosis or "")
    far = tmp_path / "far"
    far.mkdir()
    check = _rng_case(far, (40, 40), (40 + WORDS + 1, 40 + WORDS + 1))  # no shift within reach: another stream
    assert check.causes == (Cause.RNG_AFTER_RESUME,)
    assert f"not the reference's within {WORDS:,} draws either way" in (check.diagnosis or "")
    assert "so they were not restored" in (check.diagnosis or "") and "DataLoader" not in (check.diagnosis or "")


def test_stream_distances_are_measured_both_ways_and_in_pythons_stream() -> None:
    a, b = _rank(10), _rank(10)
    r = random.Random(0)
    r.getrandbits(32 * 700)  # across a block of the twister
    b["python"] = r.getstate()
    (found,) = rank_streams([a], [b])
    assert found.differ == ("python",) and found.shifts == {"python": 700}
    (back,) = rank_streams([b], [a])
    assert back.shifts == {"python": -700}
    assert rank_streams([a], [a, a]) == () and rank_streams({"torch": 1}, [a]) == ()
    bad = dict(a, torch=torch.zeros(3, dtype=torch.uint8))  # not a generator's state: not measured, never raised
    assert rank_streams([a], [bad])[0].shifts == {"torch": None}


def _position(step: int, ahead: int = 0) -> dict[str, Any]:
    """A ResumableDistributedSampler's state: 4 samples a step over a dataset of 96, one process."""
    consumed = 4 * step + ahead
    return {
        "epoch": consumed // 96,
        "consumed": consumed % 96,
        "num_samples": 96,
        "shuffle": True,
        "seed": 0,
        "drop_last": False,
        "world_size": 1,
    }


@pytest.mark.parametrize(("ahead", "cause"), [(4, Cause.BATCH_HELD), (12, Cause.DATA_POSITION)], ids=["1", "3"])
def test_a_data_position_ahead_after_a_resume_is_named_by_how_far(tmp_path: Path, ahead: int, cause: Cause) -> None:
    # one step's samples ahead: the batch held across the save was skipped; three steps': workers that prefetched
    rng = _ranks(40)
    ref = {s: {"rng": rng, "moved": False, "sampler": _position(s)} for s in STEPS}
    got = {s: {"rng": rng, "moved": s > 2, "sampler": _position(s, ahead if s > 2 else 0)} for s in STEPS}
    check = _check(tmp_path, ref, got)
    assert check.causes == (cause,), check.diagnosis
    text = check.diagnosis or ""
    assert text.startswith(
        f"the data position at step 4 (ckpt_00000004.pt, written after a resume) is {ahead} "
        f"samples ahead of the reference's (sample {16 + ahead} of the run vs 16; 4 samples a step"
    )
    assert ("one step's worth: a batch drawn before the save" in text) == (cause is Cause.BATCH_HELD)
    assert ("workers prefetches" in text) == (cause is Cause.DATA_POSITION)


def test_no_cause_is_named_without_evidence(tmp_path: Path) -> None:
    # the model differs after the resume, the RNG streams and the data position are equal, the run is not DDP:
    # nothing shows a cause
    rng = _ranks(40, 40, 40)
    ref = {s: {"rng": rng, "moved": False, "sampler": _position(s)} for s in STEPS}
    got = {s: {**ref[s], "moved": s > 2} for s in STEPS}
    check = _check(tmp_path, ref, got)
    assert not check.exact and check.causes == ()
    assert (check.diagnosis or "").startswith(
        "no known cause fits: the first difference is at step 4 (ckpt_00000004.pt, written after a resume), model "
        "weight: values differ"
    )
    assert "  diagnosis    no known cause fits: the first difference is at step 4" in check.report()

    # nanoGPT's checkpoint holds no data position and no RNG streams: with the model differing, the missing parts
    # are evidence enough to name
    def steps(history: str) -> dict[int, dict[str, Any]]:
        return {s: {"rng": None, "moved": False, "extra": {"history": history if s > 2 else "a"}} for s in STEPS}

    moved = tmp_path / "moved"
    moved.mkdir()
    check = _check(moved, steps("a"), {s: {**v, "moved": s > 2} for s, v in steps("a").items()})
    assert check.causes == (Cause.DATA_POSITION_NOT_SAVED, Cause.RNG_NOT_SAVED)
    assert (check.diagnosis or "").startswith(
        "the checkpoints hold no data position, and the model differs at step 4 (ckpt_00000004.pt, written after a "
        "resume) (model weight: values differ"
    )


def _args(start_epoch: int) -> dict[str, Any]:
    return {"start_epoch": start_epoch, "lr": 0.1, "workers": 2}


def test_extra_alone_is_exact_with_its_keys_named_and_a_difference_under_strict_extra(tmp_path: Path) -> None:
    # torchvision's reference script sets args.start_epoch at a resume and saves args with every checkpoint; every
    # trained tensor is equal
    rng = _ranks(40)
    ref = {s: {"rng": rng, "moved": False, "extra": {"args": _args(0), "epochs": 3}} for s in STEPS}
    got = {s: {**ref[s], "extra": {"args": _args(1 if s > 2 else 0), "epochs": 3}} for s in STEPS}
    check = _check(tmp_path, ref, got)
    assert check.exact and check.causes == () and check.diagnosis is None and check.first_difference is None
    assert check.extra_differs == ("['args']['start_epoch']",)
    assert check.steps == ((2, True), (4, True), (6, True))
    report = check.report()
    assert report.startswith("exact: interrupted 1 time(s), the trained state ended bitwise equal to the uninterrupted")
    assert "  extra        extra['args']['start_epoch'] differs: the script's own entries" in report
    assert "--strict-extra" in report and check.as_dict()["extra_differs"] == ["['args']['start_epoch']"]
    strict = tmp_path / "strict"
    strict.mkdir()
    check = _check(strict, ref, got, strict_extra=True)
    assert not check.exact and check.causes == (Cause.EXTRA_DIFFERS,) and check.extra_differs == ()
    assert (check.diagnosis or "").startswith(
        "only extra differs (from step 4 (ckpt_00000004.pt, written after a resume) on): "
        "extra['args']['start_epoch'] differs"
    )
    # extra and the model differ: not exact, diagnosed where the model differs (extra is no cause of its own)
    moved = tmp_path / "moved"
    moved.mkdir()
    check = _check(moved, ref, {s: {**got[s], "moved": s > 4} for s in STEPS})
    assert not check.exact and Cause.EXTRA_DIFFERS not in check.causes and check.extra_differs == ()
    assert "at step 6 (ckpt_00000006.pt" in (check.diagnosis or "")


PREFETCHED: dict[str, Any] = {
    "workers": 2,
    "prefetch_factor": 1,
    "warning": "dataloader= is a DataLoader with 2 worker(s) ...",
}


def test_a_data_position_recorded_to_count_prefetched_batches_is_named_before_the_streams(tmp_path: Path) -> None:
    # the torchvision loader (workers, not persistent): the saved position counts the prefetched batches, a relaunch
    # skips them, reaches the epoch's end sooner and draws the next epoch's seed earlier: the data position is one
    # step's samples ahead and every stream 8 draws ahead. Without the record these read as a batch held ahead
    def runs(meta: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
        ref = {s: {"rng": _ranks(40), "moved": False, "sampler": _position(s), "meta": meta} for s in STEPS}
        ahead = {"rng": _ranks(48), "moved": True, "meta": meta}
        return ref, {s: ref[s] if s == 2 else {**ahead, "sampler": _position(s, 4)} for s in STEPS}

    check = _check(tmp_path, *runs({}))
    assert check.causes == (Cause.BATCH_HELD,), check.diagnosis
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    check = _check(recorded, *runs({"data_position_prefetched": PREFETCHED}))
    assert check.causes == (Cause.DATA_POSITION,), check.diagnosis
    text = check.diagnosis or ""
    assert text.startswith(
        "the data position differs at step 4 (ckpt_00000004.pt, written after a resume), 4 samples ahead of the "
        "reference's (sample 20 of the run vs 16), and the checkpoints record that it counts the batches a "
        "DataLoader's 2 worker(s) prefetched (1 each), not only those trained on: the resumed run skipped them"
    )
    assert PREFETCHED["warning"] in text and "RNG streams differ" not in text and "held" not in text


def test_a_prefetch_record_is_no_cause_where_the_data_position_is_equal(tmp_path: Path) -> None:
    # the record says the position could count prefetched batches, but it is equal after the resume: the streams
    # that differ are named by their distance, as without it
    ref = {s: {"rng": _ranks(40), "moved": False, "sampler": _position(s)} for s in STEPS}
    for step in STEPS:
        ref[step]["meta"] = {"data_position_prefetched": PREFETCHED}
    got = {s: ref[s] if s == 2 else {**ref[s], "rng": _ranks(42), "moved": True} for s in STEPS}
    check = _check(tmp_path, ref, got)
    assert check.causes == (Cause.RNG_AFTER_RESUME,), check.diagnosis
    assert "prefetched" not in (check.diagnosis or "")


def _ddp(meta: dict[str, Any], ranks: int = 4, *, first_equal: bool = False) -> tuple[dict[int, Any], dict[int, Any]]:
    """A DDP run at ``ranks`` ranks whose model and optimizer differ after the resume, streams and data position
    equal; ``first_equal``: the relaunch's first checkpoint (step 4) is still equal."""
    ref = {s: {"rng": _ranks(*[40] * ranks), "moved": False, "sampler": _position(s), "meta": meta} for s in STEPS}
    moved_from = 6 if first_equal else 4
    return ref, {s: {**ref[s], "moved": s >= moved_from} for s in STEPS}


def test_a_ddp_resume_without_a_recorded_bucket_layout_is_named_past_two_ranks(tmp_path: Path) -> None:
    check = _check(tmp_path, *_ddp({"ddp": True}))
    assert check.causes == (Cause.DDP_FIRST_STEP_BUCKETS,), check.diagnosis
    text = check.diagnosis or ""
    assert text.startswith(
        "the training state differs at step 4 (ckpt_00000004.pt, written after a resume) (model weight: values differ"
    )
    assert "the first checkpoint after the resume, while the RNG streams and the data position are equal" in text
    assert "the run is DDP at 4 ranks, and its checkpoints record no bucket layout (meta 'ddp_buckets')" in text
    assert "no known cause fits" not in text
    # no evidence, no cause: a recorded layout, 2 ranks, a run not saved from DDP, or a relaunch whose first
    # checkpoint was equal
    for name, (ref, got) in {
        "recorded": _ddp({"ddp": True, "ddp_buckets": [[3, 2], [1, 0]]}),
        "two": _ddp({"ddp": True}, ranks=2),
        "plain": _ddp({}),
        "later": _ddp({"ddp": True}, first_equal=True),
    }.items():
        folder = tmp_path / name
        folder.mkdir()
        check = _check(folder, ref, got)
        assert check.causes == () and (check.diagnosis or "").startswith("no known cause fits"), (name, check.diagnosis)


def test_a_ddp_resume_that_could_not_replay_its_layout_is_named_with_the_reason(tmp_path: Path) -> None:
    reason = "rank 0: the DDP model ran a forward pass before the resume; resume before training"
    ref, got = _ddp({"ddp": True, "ddp_buckets": [[3, 2], [1, 0]]})
    for step in got:
        if step >= 4:  # the relaunch's checkpoints say why its resume could not replay the layout
            got[step] = {**got[step], "meta": {**got[step]["meta"], "ddp_buckets_not_replayed": reason}}
    check = _check(tmp_path, ref, got)
    assert check.causes == (Cause.DDP_FIRST_STEP_BUCKETS,), check.diagnosis
    assert "its resume could not give DDP the saved bucket layout (rank 0: the DDP model ran a forward pass" in (
        check.diagnosis or ""
    )


def test_a_prefetch_record_is_read_only_in_its_own_form() -> None:
    # a file may hold anything under the key: only positive ints count, and a long WARNING is quoted cut
    from dist_resume.cli.check._diagnose_setup import _prefetched

    assert _prefetched({"workers": 2, "prefetch_factor": 3, "warning": 7}) == (2, 3, "")
    for odd in (None, "2 workers", {"workers": True, "prefetch_factor": 2}, {"workers": 2, "prefetch_factor": -1}):
        assert _prefetched(odd) is None, odd
    long = _prefetched({"workers": 1, "prefetch_factor": 2, "warning": "w" * 5000})
    assert long is not None and len(long[2]) == 1000 and long[2].endswith("...")
