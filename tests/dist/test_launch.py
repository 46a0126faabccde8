"""launch/train.py and the launch scripts under the real torchrun (gloo on localhost).

Every launch costs seconds on a 2-core machine, so each test launches a few runs and checks
many things about them. Timeouts nest: train.py's --timeout (process group) < each launch's
timeout < the test's pytest timeout.
"""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from subprocess import CompletedProcess
from typing import Any

import pytest
import torch
import torch.distributed as dist

import dist_resume
from tests.dist import harness
from tests.dist.harness import RankFailure, run_ranks, run_torchrun

pytestmark = pytest.mark.dist

REPO = harness.REPO_ROOT
TRAIN = str(REPO / "launch" / "train.py")
# 256 samples, batch 16: an epoch is 8 steps on 2 ranks, 16 on 1, 4 on 4
COMMON = [
    "--steps",
    "20",
    "--save-every",
    "8",
    "--batch-size",
    "16",
    "--num-samples",
    "256",
    "--log-every",
    "100",
    "--timeout",
    "60",
]
TORCHRUN = f"{sys.executable} -m torch.distributed.run"  # what the scripts run instead of `torchrun`
LAUNCH_TIMEOUT = 100.0


def _launch(
    cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = LAUNCH_TIMEOUT
) -> CompletedProcess[str]:
    """One command (a launch script or a single-process run) with the harness's kill-on-timeout."""
    return harness._launch([cmd], cwd, {"TORCHRUN": TORCHRUN, **(env or {})}, timeout)[0]


def _ok(res: CompletedProcess[str]) -> str:
    out = res.stdout + res.stderr
    assert res.returncode == 0, f"{' '.join(res.args)} exited with {res.returncode}\n{out[-5000:]}"
    return out


def _records(folder: Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> the JSON lines train.py --dump-losses wrote, in order."""
    return {
        int(f.stem[4:]): [json.loads(line) for line in f.read_text().splitlines()]
        for f in sorted(folder.glob("rank*.jsonl"))
    }


def _losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """step -> loss; a step recomputed after a restart overrides the first attempt's value."""
    return {r["step"]: r["loss"] for r in records}


def _assert_bitwise_equal(path: Path, reference: Path) -> None:
    got, want = torch.load(path, weights_only=True), torch.load(reference, weights_only=True)
    assert got["step"] == want["step"]
    assert got["model"].keys() == want["model"].keys()
    for key, value in want["model"].items():
        assert torch.equal(got["model"][key], value), f"model {key} differs from the uninterrupted run"
    opt_got, opt_want = got["optimizer"]["state"], want["optimizer"]["state"]
    assert opt_got.keys() == opt_want.keys() and opt_want
    for pid, state in opt_want.items():
        for name, value in state.items():
            assert torch.equal(opt_got[pid][name], value), f"optimizer state[{pid}][{name!r}] differs"
    assert got["optimizer"]["param_groups"] == want["optimizer"]["param_groups"]
    assert got["scheduler"] == want["scheduler"]


def _seen_once(indices: list[int], n: int) -> None:
    counts = collections.Counter(indices)
    twice = sorted(i for i, c in counts.items() if c > 1)
    missing = sorted(set(range(n)) - set(counts))
    assert not twice and not missing, f"seen twice: {twice[:10]}, never seen: {missing[:10]}"


def _per_rank_state_worker(rank: int, world_size: int, path: str, skew: bool) -> dict[str, Any]:
    """Save with every rank's RNG and sampler state, then resume: each rank must get its own stream back."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5))
    dist_resume.seed_rng(3, rank=rank)
    sampler = dist_resume.ResumableDistributedSampler(64, seed=1)
    it = iter(sampler)
    for _ in range(5 + (rank if skew else 0)):
        next(it)
    dist_resume.save_checkpoint(path, model=model, step=5, dataloader=sampler)  # gathers RNG + sampler on rank 0
    expected = torch.rand(4)
    torch.rand(8)
    fresh = dist_resume.ResumableDistributedSampler(64, seed=1)
    res = dist_resume.resume(path, model=model, dataloader=fresh, options=dist_resume.ResumeOptions(rng=True))
    return {
        "restored": res.restored,
        "rand": torch.rand(4),
        "expected": expected,
        "consumed": fresh.consumed,
        "next": next(iter(fresh)),
        "want_next": next(it),
    }


def _resumed_by_one_process(tmp_path: Path, folder: str, before: dict[int, list[dict[str, Any]]]) -> None:
    """2 -> 1 ranks: a copy of ``folder``, stopped by 2 ranks at step 13 (160 of 256 samples of epoch 1), resumed in
    one process, which must see the rest of epoch 1, each sample once (1 -> 4, on two nodes, is the multi-node test's).
    ``before``: what the 2 ranks logged."""
    shutil.copytree(tmp_path / folder, tmp_path / "one")
    out = _ok(_launch([sys.executable, TRAIN, *COMMON, "--ckpt-dir", "one", "--dump-losses", "one_losses"], tmp_path))
    assert f"resumed from {tmp_path / 'one' / 'ckpt_00000013.pt'} at step " in out
    assert "continuing at step 13, epoch 1, sample 160 of 256 (saved by 2 rank(s), now 1" in out
    assert "holds RNG state for 2 rank(s) but the job has 1" in out  # the stated policy, logged
    assert "done: step 20" in out
    after = _records(tmp_path / "one_losses")
    assert [r["world_size"] for r in after[0]] == [1] * 7
    _seen_once(
        [i for rank in (0, 1) for r in before[rank] if r["epoch"] == 1 for i in r["indices"]]
        + [i for r in after[0] if r["epoch"] == 1 for i in r["indices"]],
        256,
    )
    assert {r["epoch"] for r in after[0]} == {1, 2}, "training continued into the next epoch"


def test_each_rank_gets_its_own_rng_stream_and_the_sampler_position_back(tmp_path):
    path = str(tmp_path / "c.pt")
    results = run_ranks(_per_rank_state_worker, 2, tmp_path=tmp_path, args=(path, False))
    saved = torch.load(path, weights_only=True)
    assert len(saved["rng"]) == 2 and saved["sampler"]["consumed"] == 10
    assert not torch.equal(saved["rng"][0]["torch"], saved["rng"][1]["torch"])  # per-rank streams
    for r in results:
        assert r["restored"][-2:] == ("sampler", "rng") and r["consumed"] == 10
        assert torch.equal(r["rand"], r["expected"]) and r["next"] == r["want_next"]
    assert not torch.equal(results[0]["rand"], results[1]["rand"])
    with pytest.raises(RankFailure) as err:  # ranks that drew different batch counts: refused on every rank
        run_ranks(_per_rank_state_worker, 2, tmp_path=tmp_path, args=(str(tmp_path / "skew.pt"), True))
    assert sorted(err.value.failures) == [0, 1]
    assert all("samplers are at different positions" in f for f in err.value.failures.values())


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_stopped_and_killed_runs_end_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    # reference: launch/single_node.sh, 20 uninterrupted steps on 2 ranks
    ref = _launch(
        [
            "bash",
            str(REPO / "launch/single_node.sh"),
            *COMMON,
            "--ckpt-dir",
            "ref",
            "--dump-final",
            "ref.pt",
            "--dump-losses",
            "ref_losses",
        ],
        tmp_path,
        {"NPROC_PER_NODE": "2"},
    )
    out = _ok(ref)
    assert "starting at step 0 with 2 rank(s)" in out
    # the README's demo command is quiet: no torchrun OMP_NUM_THREADS banner, no numpy warning from any process
    assert "OMP_NUM_THREADS" not in out and "NumPy" not in out and "UserWarning" not in out, out[-3000:]
    reference = _records(tmp_path / "ref_losses")
    assert sorted(reference) == [0, 1] and [r["step"] for r in reference[1]] == list(range(1, 21))

    # stop at step 13 (mid-epoch 1), then --resume auto
    first = run_torchrun(
        [TRAIN, *COMMON, "--ckpt-dir", "b", "--stop-after", "13", "--dump-losses", "b_losses"],
        nproc=2,
        cwd=tmp_path,
        timeout=LAUNCH_TIMEOUT,
    )
    out = _ok(first)
    assert "stopping at step 13 as if preempted (--stop-after 13): epoch 1, sample 160 of 256" in out
    assert "done:" not in out
    _resumed_by_one_process(tmp_path, "b", _records(tmp_path / "b_losses"))  # a copy of the folder, 2 -> 1 ranks
    second = run_torchrun(
        [TRAIN, *COMMON, "--ckpt-dir", "b", "--resume", "auto", "--dump-final", "b.pt", "--dump-losses", "b_losses"],
        nproc=2,
        cwd=tmp_path,
        timeout=LAUNCH_TIMEOUT,
    )
    out = _ok(second)
    resumed_line = next(line for line in out.splitlines() if "resumed from" in line)
    assert f"resumed from {tmp_path / 'b' / 'ckpt_00000013.pt'} at step 13 (epoch 1) in " in resumed_line
    assert resumed_line.endswith("(restored model, optimizer, scheduler, sampler, rng)")  # no GradScaler on the CPU
    assert out.count("resumed from") == 1, out[-3000:]  # said once, by the library on rank 0
    assert "continuing at step 13, epoch 1, sample 160 of 256" in out
    _assert_bitwise_equal(tmp_path / "b.pt", tmp_path / "ref.pt")
    resumed = _records(tmp_path / "b_losses")
    for rank in (0, 1):
        assert [r["step"] for r in resumed[rank]] == list(range(1, 21)), "each step exactly once"
        assert _losses(resumed[rank]) == _losses(reference[rank]), f"rank {rank}: loss sequence differs"
        assert [r["indices"] for r in resumed[rank]] == [r["indices"] for r in reference[rank]]

    # launch/elastic.sh: rank 1 SIGKILLs itself after step 11 on the first attempt; torchrun restarts the
    # group, which resumes from step 8 (the end of epoch 0) and ends bitwise equal
    elastic = _launch(
        [
            "bash",
            str(REPO / "launch/elastic.sh"),
            *COMMON,
            "--ckpt-dir",
            "e",
            "--kill-at-step",
            "11",
            "--kill-rank",
            "1",
            "--dump-final",
            "e.pt",
            "--dump-losses",
            "e_losses",
        ],
        tmp_path,
        {"NPROC_PER_NODE": "2", "MAX_RESTARTS": "2"},
        timeout=LAUNCH_TIMEOUT + 60,
    )
    out = _ok(elastic)
    assert "rank 1: SIGKILL at step 11" in out and "exitcode: -9" in out
    # saved after the last batch of epoch 0: the position saved is the start of epoch 1
    assert f"resumed from {tmp_path / 'e' / 'ckpt_00000008.pt'} at step " in out
    assert "continuing at step 8, epoch 1, sample 0 of 256" in out
    assert "attempt 1)" in out
    _assert_bitwise_equal(tmp_path / "e.pt", tmp_path / "ref.pt")
    records = _records(tmp_path / "e_losses")
    for rank in (0, 1):
        attempts: collections.defaultdict[int, dict[int, float]] = collections.defaultdict(dict)
        for r in records[rank]:
            attempts[r["attempt"]][r["step"]] = r["loss"]
        assert sorted(attempts) == [0, 1], f"rank {rank} did not run twice"
        assert max(attempts[0]) == 11 if rank == 1 else max(attempts[0]) >= 10  # lockstep: 0 lags at most 1
        assert min(attempts[1]) == 9
        redone = set(attempts[0]) & set(attempts[1])
        assert redone and all(attempts[0][s] == attempts[1][s] for s in redone), "a recomputed step differs"
        assert _losses(records[rank]) == _losses(reference[rank]), f"rank {rank}: loss sequence differs"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multi_node_script_as_two_agents_resumes_a_single_process_checkpoint(tmp_path):
    n = 256
    _ok(
        _launch(
            [sys.executable, TRAIN, *COMMON, "--ckpt-dir", "ck", "--stop-after", "3", "--dump-losses", "single"],
            tmp_path,
        )
    )  # 48 samples of epoch 0
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        multi_tenant=True,
        timeout=timedelta(seconds=LAUNCH_TIMEOUT),
    )
    env = {
        "NNODES": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(store.port),
        "RDZV_ID": uuid.uuid4().hex,
        "NPROC_PER_NODE": "2",
        "TORCHRUN": TORCHRUN,
        "TORCHRUN_ARGS": "--rdzv-conf=is_host=false --local-addr=127.0.0.1",
    }
    try:  # the store outlives both agents
        cmds = [
            [
                "env",
                f"NODE_RANK={node}",
                "bash",
                str(REPO / "launch/multi_node.sh"),
                *COMMON,
                "--steps",
                "10",
                "--ckpt-dir",
                "ck",
                "--dump-losses",
                "multi",
            ]
            for node in (0, 1)
        ]
        nodes = harness._launch(cmds, tmp_path, env, LAUNCH_TIMEOUT + 40)
    finally:
        del store
    out = "".join(_ok(node) for node in nodes)
    assert f"resumed from {tmp_path / 'ck' / 'ckpt_00000003.pt'} at step " in out
    assert "continuing at step 3, epoch 0, sample 48 of 256 (saved by 1 rank(s), now 4" in out
    assert "new streams on ranks 1-3, derived from the saved seed 0, the rank and step 3" in out
    records = _records(tmp_path / "multi")
    assert sorted(records) == [0, 1, 2, 3]
    placement = {(r["rank"], r["local_rank"], r["node_rank"], r["device"]) for rs in records.values() for r in rs}
    assert len(placement) == 4 and {p[2] for p in placement} == {0, 1}
    for rank, local_rank, node_rank, device in placement:  # two processes per node, GPU index = LOCAL_RANK
        assert local_rank == rank - 2 * node_rank and local_rank in (0, 1) and device == "cpu"
    assert {r["world_size"] for rs in records.values() for r in rs} == {4}
    _seen_once(
        [i for r in _records(tmp_path / "single")[0] for i in r["indices"]]
        + [i for rs in records.values() for r in rs if r["epoch"] == 0 for i in r["indices"]],
        n,
    )
    assert all(r["loss"] == r["loss"] for rs in records.values() for r in rs)  # no NaN
    assert [r["step"] for r in records[3]][-1] == 10


def test_common_sh_sets_omp_threads_and_hides_only_the_numpy_warning(tmp_path):
    # torchrun prints its banner only when OMP_NUM_THREADS is unset; harness runs always set it, so check here
    script = (
        f"unset OMP_NUM_THREADS; export PYTHONWARNINGS=default; source {REPO / 'launch/_common.sh'}; "
        'echo "$OMP_NUM_THREADS"; echo "$PYTHONWARNINGS"; '
        f'{sys.executable} -c "import warnings; '
        "warnings.warn('Failed to initialize NumPy: No module named numpy', UserWarning); "
        "warnings.warn('another warning', UserWarning)\""
    )
    res = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines() == ["1", "default,ignore:Failed to initialize NumPy:UserWarning"]
    assert "NumPy" not in res.stderr and "another warning" in res.stderr  # only that one warning is hidden
    res = subprocess.run(
        ["bash", "-c", f'export OMP_NUM_THREADS=3; source {REPO / "launch/_common.sh"}; echo "$OMP_NUM_THREADS"'],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.stdout.strip() == "3"  # a user's choice is kept
