"""The error hierarchy crosses process boundaries intact: pickling, and the relay between ranks."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed as dist

import dist_resume as dr
from dist_resume._core import errors as E
from dist_resume._dist import agree as B
from dist_resume._dist.comm import Outcome, RelayedError

# every public error class, with the attributes its constructor takes
_CASES: list[tuple[type[dr.DistResumeError], tuple[Any, ...], dict[str, Any]]] = [
    (dr.DistResumeError, ("base",), {}),
    (dr.errors.EnvironmentMismatchError, ("bad RANK",), {}),
    (dr.errors.CheckpointError, ("cannot read",), {}),
    (dr.errors.CheckpointNotFoundError, ("no such file",), {}),
    (dr.errors.CheckpointCorruptError, ("truncated",), {}),
    (dr.errors.NotACheckpointError, ("a zip",), {}),
    (dr.errors.UnsafeCheckpointError, ("refused",), {}),
    (dr.errors.CheckpointWriteError, ("disk full",), {}),
    (dr.errors.CheckpointConsensusError, ("ranks differ",), {"ranks": [1, 3]}),
    (dr.errors.StateMismatchError, ("no scheduler",), {}),
    (
        dr.errors.KeyMismatchError,
        ("keys",),
        {"missing": ["fc.weight"], "unexpected": ["head.bias"], "mismatched": ["x"]},
    ),
    (dr.errors.OptimizerStateMismatchError, ("groups",), {}),
    (dr.errors.DeviceMismatchError, ("devices",), {"findings": ["optimizer state on cpu, param on cuda:0"]}),
    (dr.errors.RestoreError, ("the optimizer failed",), {"part": "optimizer"}),
    (dr.errors.PartialRestoreError, ("writing the model failed",), {"part": "model"}),
    (dr.errors.UsageError, ("SRC == DST", "pick another DST"), {}),
    (dr.errors.CheckCommandError, ("failed on its own",), {"run": "reference", "returncode": 1, "stderr": "boom"}),
    (dr.errors.SimBuildError, ("the compiler failed",), {}),
]


def test_every_error_class_is_covered() -> None:
    public = {getattr(dr.errors, name) for name in E.__all__ if isinstance(getattr(dr.errors, name, None), type)}
    assert public == {cls for cls, _, _ in _CASES}


@pytest.mark.parametrize(("cls", "args", "kwargs"), _CASES, ids=[c[0].__name__ for c in _CASES])
def test_error_round_trips_through_pickle_with_its_attributes(
    cls: type[dr.DistResumeError], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    err = cls(*args, **kwargs)
    err.rank = 2
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is cls and str(back) == str(err) == args[0]
    assert vars(back) == vars(err) and back.rank == 2
    for key, value in kwargs.items():
        assert getattr(back, key) == value
    if cls is dr.errors.UsageError:
        assert isinstance(back, dr.errors.UsageError) and back.hint == "pick another DST"


def test_a_subclass_with_a_required_keyword_still_pickles() -> None:
    class _Strict(dr.DistResumeError):  # BaseException's own reduction would call _Strict("msg") and fail
        def __init__(self, message: str, *, code: int) -> None:
            super().__init__(message)
            self.code = code

    globals()["_Strict"] = _Strict  # picklable by name
    _Strict.__qualname__ = "_Strict"
    try:
        back = pickle.loads(pickle.dumps(_Strict("msg", code=7)))
    finally:
        del globals()["_Strict"]
    assert (type(back).__name__, str(back), back.code) == ("_Strict", "msg", 7)


def _relay(err: BaseException, rank: int = 1, fallback: type[dr.DistResumeError] = dr.errors.CheckpointError) -> Any:
    """What another rank rebuilds from ``err``, after the wire (a pickle round trip)."""
    relayed = pickle.loads(pickle.dumps(RelayedError.of(rank, err)))
    return relayed.rebuild(fallback)


def test_relayed_error_keeps_class_attributes_and_names_its_rank() -> None:
    got = _relay(dr.errors.KeyMismatchError("keys", missing=["a", "b"], unexpected=["c"]), rank=3)
    assert type(got) is dr.errors.KeyMismatchError and got.missing == ["a", "b"] and got.unexpected == ["c"]
    assert got.rank == 3 and str(got) == "keys"


def test_an_error_that_does_not_pickle_arrives_as_class_message_and_attributes() -> None:
    err = dr.errors.UsageError("cannot convert", "pass --force")
    err.callback = lambda: None  # type: ignore[attr-defined]
    with pytest.raises((AttributeError, pickle.PicklingError, TypeError)):  # whatever pickle raises for a lambda
        pickle.dumps(err)
    relayed = RelayedError.of(1, err)
    assert relayed.pickled is None
    got = _relay(err)
    assert type(got) is dr.errors.UsageError and str(got) == "cannot convert" and got.hint == "pass --force"
    assert got.rank == 1 and vars(got)["callback"].startswith("<function")  # what did not pickle, as its repr


def test_an_error_whose_class_is_not_importable_arrives_as_its_dist_resume_class() -> None:
    relayed = RelayedError(1, "dist_resume._core.errors.KeyMismatchError", "keys", {"missing": ["w"]}, b"garbage")
    got = relayed.rebuild(dr.errors.CheckpointError)
    assert type(got) is dr.errors.KeyMismatchError and got.missing == ["w"] and got.rank == 1


def test_a_foreign_exception_becomes_the_fallback_chained_to_it() -> None:
    got = _relay(PermissionError(13, "denied"), rank=0, fallback=dr.errors.CheckpointWriteError)
    assert type(got) is dr.errors.CheckpointWriteError and got.rank == 0
    assert str(got).startswith("PermissionError: ") and "denied" in str(got)
    assert isinstance(got.__cause__, PermissionError)
    unpicklable = ValueError("bad")
    unpicklable.hook = lambda: None  # type: ignore[attr-defined]
    got = _relay(unpicklable, fallback=dr.errors.StateMismatchError)
    assert type(got) is dr.errors.StateMismatchError and str(got) == "ValueError: bad" and got.__cause__ is None


def test_outcome_run_carries_the_value_or_the_error() -> None:
    ok, failure = Outcome.run(lambda: 5, rank=0)
    assert (ok.value, ok.error, failure) == (5, None, None)

    def fails() -> None:
        raise dr.errors.DeviceMismatchError("devices", findings=["f"])

    bad, failure = Outcome.run(fails, rank=0)
    assert isinstance(failure, dr.errors.DeviceMismatchError) and bad.error is not None and bad.error.rank == 0


def _agree_on_rank(monkeypatch: pytest.MonkeyPatch, rank: int, errors: list[BaseException | None]) -> None:
    """agree_across_ranks as ``rank`` sees it when the ranks passed ``errors`` (the gather is replayed)."""
    wire = [pickle.loads(pickle.dumps(Outcome() if e is None else Outcome.failed(r, e))) for r, e in enumerate(errors)]
    monkeypatch.setattr(dist, "get_rank", lambda: rank)  # torch.distributed, which broadcast asks
    monkeypatch.setattr(B, "all_gather_objects", lambda mine: wire)
    B.agree_across_ranks(errors[rank])


def test_agreement_raises_the_lowest_failing_ranks_error_and_names_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[BaseException | None] = [
        None,
        None,
        dr.errors.KeyMismatchError("model keys differ", missing=["fc.weight"]),
        dr.errors.DeviceMismatchError("devices differ", findings=["x"]),
    ]
    with pytest.raises(dr.errors.KeyMismatchError) as info:
        _agree_on_rank(monkeypatch, 0, errors)
    assert info.value.missing == ["fc.weight"] and info.value.rank == 2
    msg = str(info.value)
    assert "rank(s) [2, 3]" in msg and "nothing was restored on any rank" in msg and "model keys differ" in msg
    _agree_on_rank(monkeypatch, 3, errors)  # a rank that failed itself returns: its caller raises its own error
    _agree_on_rank(monkeypatch, 0, [None, None])  # nobody failed


def test_agreement_turns_a_foreign_error_into_state_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(
        dr.errors.StateMismatchError, match=r"rank\(s\) \[1\].*rank 1: RuntimeError: size mismatch"
    ) as info:
        _agree_on_rank(monkeypatch, 0, [None, RuntimeError("size mismatch")])
    assert isinstance(info.value.__cause__, RuntimeError) and info.value.rank == 1
