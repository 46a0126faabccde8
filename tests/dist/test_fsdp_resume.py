"""``resume`` / ``CheckpointManager.resume`` into FSDP2 models (fully_shard on a CPU mesh, gloo), every direction.

One test, three launches sharing one folder: 2 ranks (1-D mesh; writes the checkpoints and the uninterrupted runs'
full states), 4 ranks (2x2 HSDP), 1 rank. At the same world size the continued run must equal the uninterrupted one
bit for bit; at another world size within :data:`TOLERANCE` (fp32 sums in another order; measured here: 6.0e-8 for
2->4 and 1->2, 7.5e-9 for 2->1 and 4->1, on values of order 0.1 to 1).
"""

from __future__ import annotations

import pytest

from tests.dist import fsdp_resume_workers as RW
from tests.dist.harness import run_ranks

pytestmark = pytest.mark.dist

TOLERANCE = 1e-6
EVERYTHING = ("model", "optimizer", "scheduler", "rng")
RESULT = (RW.STEPS, EVERYTHING, (6, 6))  # step, parts restored, parameters whose optimizer state was restored


def _refused(outcomes: list[dict], error: str, failing: int | None) -> None:
    """Every rank raised ``error`` (no raw torch error), the same message (the failing rank's, named), and no rank's
    model or optimizer changed."""
    for rank, o in enumerate(outcomes):
        assert o["error"] == error and o["unchanged"] == [], (rank, o)
        assert o["rank"] == (None if rank == failing or failing is None else failing), (rank, o)
    own = outcomes[failing or 0]["message"]  # the failing rank's own words end every rank's message
    assert all(o["message"].endswith(own) for o in outcomes), [o["message"] for o in outcomes]


def _check_two(results: list[dict]) -> None:
    for rank, r in enumerate(results):
        for name in ("fsdp_folder", "fsdp_full_file", "fsdp_broadcast", "from_ddp", "from_ddp_broadcast"):
            assert r[f"{name}_result"] == RESULT, (rank, name, r[f"{name}_result"])
        for check in (
            "fsdp_folder",  # FSDP2@2 -> FSDP2@2 through the sharded folder (dcp.load into the shards)
            "fsdp_folder_at_save",
            "fsdp_full_file",  # ... through its full_state=True file
            "fsdp_full_file_at_save",
            "fsdp_broadcast",  # ... rank 0 reading the folder, scattering the boxes
            "fsdp_broadcast_at_save",
            "to_ddp",  # FSDP2@2 -> DDP@2
            "from_ddp",  # DDP@2 -> FSDP2@2, equal to DDP's own continuation
            "from_ddp_broadcast",
            "ddp_vs_fsdp",
            "compiled",  # torch.compile of a root-only wrapped model
            "single_at_save",  # a single-GPU file, integer-id optimizer state: restored exactly
        ):
            assert r[check] == [], (rank, check, r[check])
        assert r["to_ddp_result"] == RESULT and r["compiled_result"] == RESULT
        assert r["dcp_result"] == ("model", "optimizer") and r["dcp_at_save"] == [], rank  # torch's own DCP folder
        assert r["manager_result"] == RW.STEPS and r["manager_root_only"] == 0.0, rank
        assert r["single_result"] == (RW.STEPS, ("model", "optimizer", "scheduler"), (6, 6))
        assert r["single_step"] == RW.STEPS  # not DSD's trap (FACTS 33: state ignored, step 1)
        assert r["single_broadcast_result"] == r["single_result"] and r["single_broadcast_at_save"] == [], rank
        assert r["single_continued"] <= TOLERANCE, r["single_continued"]  # world size 1 -> 2
    for where, error, failing in (
        ("bad_everywhere", "KeyMismatchError", None),
        ("bad_on_rank1", "KeyMismatchError", 1),
        ("wrong_optimizer", "OptimizerStateMismatchError", None),
        ("missing_on_rank1", "CheckpointNotFoundError", 1),
    ):
        _refused([r[where] for r in results], error, failing)
    told = results[0]["bad_on_rank1"]["message"]
    assert told.startswith("rank(s) [1] could not restore the checkpoint into the FSDP2 model, so nothing was restored")
    assert "b.weight: checkpoint (7, 4), model (7, 3)" in told
    # a damaged sharded folder: every CRC-32 is checked before anything changes (the ranks split the check; all of it
    # each under verify=True), and with it every entry's header; damage whose CRC-32 was made to match and that no
    # header shows is found while the shards fill, and every rank raises the same error saying so
    _refused([r["damaged_verified"] for r in results], "CheckpointCorruptError", None)
    for o in (r["damaged"] for r in results):  # rank 0 finds its CRC-32 wrong, rank 1 its objects damaged
        assert o["error"] == "CheckpointCorruptError" and o["unchanged"] == [] and "__1_0.distcp" in o["message"], o
    for o in (r["damaged_header"] for r in results):  # a chunk's header, CRC-32 made to match: read with the CRC-32s
        assert o["error"] == "CheckpointCorruptError" and o["unchanged"] == [] and "__1_0.distcp" in o["message"], o
    chunk = {r["damaged_chunk"] for r in results}
    assert len(chunk) == 1, chunk
    ((error, message),) = chunk
    assert error == "PartialRestoreError" and "__1_0.distcp" in message and "may hold part of the checkpoint" in message
    _check_more(results)


def _check_more(results: list[dict]) -> None:
    """tests/dist/fsdp_resume_extra.py's checks: init_from, safetensors/HF/Accelerate, EMA, load_checkpoint."""
    for rank, r in enumerate(results):
        assert r["init_weights"] == (0, ("model",), []), (rank, r["init_weights"])
        assert r["init_ddp"][:2] == (0, ("model", "optimizer")) and r["init_ddp"][2] == [], (rank, r["init_ddp"])
        assert r["safetensors"] == ("safetensors", ("model",), []), (rank, r["safetensors"])
        assert r["hf"] == ("hf-trainer", ("model", "optimizer", "scheduler"), []), (rank, r["hf"])
        assert r["hf_broadcast"] == r["hf"], (rank, r["hf_broadcast"])  # rank 0 reads, sends the boxes
        assert r["accelerate"] == ("accelerate", ("model", "optimizer"), []), (rank, r["accelerate"])
        for name in ("ema_plain_folder", "ema_plain_full", "ema_sharded_folder", "ema_sharded_full"):
            restored, diff = r[name]
            assert "ema" in restored and diff == [], (rank, name, r[name])
        assert r["ema_sharded_n_averaged"] == 2, rank
        error, message = r["ema_sharded_plain_model"]
        assert error == "UsageError" and "AveragedModel of a plain copy" in message, (rank, message)
    keys, diff, named = results[0]["load_checkpoint"]  # a sharded folder: its full state, on rank 0 alone
    assert {"model", "optimizer", "step"} <= set(keys) and diff == [] and named, results[0]["load_checkpoint"]


def _check_other(results: list[dict], world_size: int) -> None:
    names = ("folder", "folder_broadcast", "full_file", "ddp_file", "manager") + (
        ("from_four",) if world_size == 1 else ()
    )
    for rank, r in enumerate(results):
        for name in names:
            assert r[name] <= TOLERANCE, (world_size, rank, name, r[name])
            if name != "manager":
                assert r[f"{name}_result"] == RESULT, (world_size, rank, name, r[f"{name}_result"])
        assert r["manager_result"] == RW.STEPS
        assert r["dcp_result"] == ("model", "optimizer") and r["dcp_at_save"] == [], rank  # resharded, exact
        assert world_size != 1 or r["full_at_one"] == [], r["full_at_one"]
        assert r["init_weights"] == (0, ("model",), []), (world_size, rank, r["init_weights"])
        assert r["hf"] == ("hf-trainer", ("model", "optimizer", "scheduler"), []), (world_size, rank, r["hf"])
    _refused([r["bad_on_last"] for r in results], "KeyMismatchError", world_size - 1 if world_size > 1 else None)


def test_fsdp2_resumes_from_every_source_at_2_4_and_1_ranks(tmp_path):
    folder = str(tmp_path / "shared")
    (tmp_path / "shared").mkdir()
    two = run_ranks(RW.fsdp_resumes, 2, tmp_path=tmp_path, args=(folder,), deadline=200, pg_timeout=90)
    _check_two(two)
    four = run_ranks(RW.fsdp_resumes, 4, tmp_path=tmp_path, args=(folder,), deadline=200, pg_timeout=90)
    _check_other(four, 4)
    one = run_ranks(RW.fsdp_resumes, 1, tmp_path=tmp_path, args=(folder,), deadline=200, pg_timeout=90)
    _check_other(one, 1)
    # a fault at a step puts everything back (RestoreError naming it): the small states, and the optimizer's load,
    # which runs before the shards are filled (the fill comes last, once nothing else can fail: no copy is kept)
    faults = one[0]["apply_faults"]
    assert faults["scheduler"] == ("RestoreError", "scheduler", True, True, True), faults
    assert faults["rng"] == ("RestoreError", "rng", True, True, True), faults
    assert faults["fill"] == ("RestoreError", "optimizer", True, True, True), faults
