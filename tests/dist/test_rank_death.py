"""A rank SIGKILLed mid-collective: the survivors raise a dist_resume error naming their step, within the
process-group timeout, and the checkpoint files stay valid (real gloo processes, tests/dist/harness.py).

The harness (not torchrun) launches the ranks, so nothing but the library's own error handling ends
the survivors' wait. Timeouts nest: process-group timeout < harness deadline < pytest timeout.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import dist_resume as dr
from dist_resume._core.torch_compat.wording import CommFailure, classify_comm_error
from dist_resume._dist.comm import collective_step
from tests.dist import death_workers as W
from tests.dist.harness import RankFailure, run_ranks

PG_TIMEOUT = 10.0
MARGIN = 5.0  # the survivors must not wait out more than the process-group timeout and this


def _survivor_reports(tmp_path: Path, fn: Any, args: tuple[Any, ...], victim: int) -> list[dict[str, Any]]:
    """Launch 2 ranks; check that exactly ``victim`` died by SIGKILL; the other rank's report."""
    with pytest.raises(RankFailure) as failed:
        run_ranks(fn, 2, tmp_path=tmp_path, args=(str(tmp_path), *args), pg_timeout=PG_TIMEOUT, deadline=45)
    assert set(failed.value.failures) == {victim}, str(failed.value)
    assert "exited with code -9" in failed.value.failures[victim], str(failed.value)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2) if r != victim]
    for report in reports:
        assert report["elapsed"] < PG_TIMEOUT + MARGIN, report  # never a hang, at worst the timeout
        assert "lost contact with the other ranks while" in report["message"], report
        assert "restart the job" in report["message"], report
    return reports


def _checkpoint(path: Path) -> Path:
    model, opt = W.make(seed=1)
    return Path(dr.save_checkpoint(path, model=model, optimizer=opt, step=7))


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_rank0_dies_while_buckets_stream(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt.pt")
    # the small states' stream takes 5 buckets, the tensors written into the live ones 6: rank 0 dies in the latter
    (r1,) = _survivor_reports(tmp_path, W.broadcast_rank_dies, (str(ckpt), 0, 8), victim=0)
    assert r1["error"] == "CheckpointError", r1
    found = re.search(r"while receiving the broadcast checkpoint's tensors \(bucket 3 of (\d+)\)", r1["message"])
    assert found and int(found.group(1)) > 3, r1["message"]
    assert "another rank's process is gone" in r1["message"], r1["message"]
    assert "model and optimizer may hold part of the checkpoint" in r1["message"], r1["message"]
    assert (r1["loads"], r1["step"]) == (True, 7), r1


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_receiver_dies_while_buckets_stream(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt.pt")
    (r0,) = _survivor_reports(tmp_path, W.broadcast_rank_dies, (str(ckpt), 1, 3), victim=1)
    assert r0["error"] == "CheckpointError", r0
    found = re.search(r"while sending the broadcast checkpoint's small states \(bucket (\d+) of (\d+)\)", r0["message"])
    assert found and 3 <= int(found.group(1)) <= int(found.group(2)), r0["message"]
    assert "may hold part" not in r0["message"], r0["message"]  # nothing changes before the small states arrived
    assert (r0["loads"], r0["step"]) == (True, 7), r0


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_rank_dies_during_the_consensus(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    manager = dr.CheckpointManager(folder)
    model, opt = W.make(seed=1)
    for step in (1, 2):
        manager.save(step, model=model, optimizer=opt)
    (r0,) = _survivor_reports(tmp_path, W.consensus_rank_dies, (str(folder), 1), victim=1)
    assert (r0["error"], r0["ranks"]) == ("CheckpointConsensusError", []), r0
    assert f"while agreeing on the checkpoint rank 0 chose in {str(folder)!r} (ckpt_00000002.pt)" in r0["message"]
    assert "did not call resume() with a checkpoint folder" in r0["message"], r0["message"]
    assert r0["latest"] == str(folder / "ckpt_00000002.pt") and r0["loads"], r0


@pytest.mark.dist
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["save", "async"])
def test_rank0_dies_while_writing(tmp_path: Path, how: str) -> None:
    folder = tmp_path / "ckpts"
    (r1,) = _survivor_reports(tmp_path, W.save_writer_dies, (str(folder), how), victim=0)
    assert r1["error"] == "CheckpointWriteError", r1
    assert "while waiting for rank 0 to write the checkpoint" in r1["message"], r1["message"]
    # the torn write never took the place of a checkpoint: the previous one is the latest and loads
    assert r1["latest"] == str(folder / "ckpt_00000001.pt") and (r1["loads"], r1["step"]) == (True, 1), r1
    assert "ckpt_00000002.pt" not in r1["names"], r1["names"]
    assert dr.tools.latest_checkpoint(folder) == folder / "ckpt_00000001.pt"


# --- the conversion itself, in one process -------------------------------------------------------------------


def test_collective_step_names_the_step_and_the_cause() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1234. "
        "This is typically caused by a remote worker crashing."
    )
    with (
        pytest.raises(dr.errors.CheckpointWriteError) as caught,
        collective_step("waiting for rank 0 to write", dr.errors.CheckpointWriteError),
    ):
        raise gloo
    message = str(caught.value)
    assert "while waiting for rank 0 to write: another rank's process is gone" in message, message
    assert "(RuntimeError: Connection closed by peer [127.0.0.1]:1234)" in message, message
    assert caught.value.__cause__ is gloo
    with (
        pytest.raises(dr.errors.CheckpointError, match="no answer within the process-group timeout"),
        collective_step("x", dr.errors.CheckpointError),
    ):
        raise torch.distributed.DistBackendError("Timed out waiting 10000ms for recv operation to complete")


@pytest.mark.parametrize(
    "err",
    [
        dr.errors.DeviceMismatchError("a dist_resume error that is a RuntimeError"),
        KeyboardInterrupt(),
        ValueError("not a collective's failure"),
    ],
)
def test_collective_step_lets_everything_else_through(err: BaseException) -> None:
    with pytest.raises(type(err)) as caught, collective_step("x", dr.errors.CheckpointError):
        raise err
    assert caught.value is err


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Read error [127.0.0.1]:23274: Connection reset by peer", CommFailure.PEER_GONE),
        ("Write error: Broken pipe", CommFailure.PEER_GONE),
        ("Timed out waiting 4000ms for send operation to complete", CommFailure.TIMEOUT),
        ("Socket Timeout", CommFailure.TIMEOUT),
        ("Invalid scalar type", CommFailure.OTHER),
    ],
)
def test_comm_errors_are_classified(text: str, kind: CommFailure) -> None:
    assert classify_comm_error(RuntimeError(text)) is kind
