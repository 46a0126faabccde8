#!/usr/bin/env python
"""Snapshots in host memory (issue 37): the training loop's stall, a restart after a SIGKILL, the memory held.

Every figure is measured in one run, beside what it is compared with, on a DDP model of four square ``Linear``
layers (no bias) with its AdamW state: ``--size-mib`` in all (1024 by default: 341 MiB of weights, 341 MiB of
``exp_avg``, 341 MiB of ``exp_avg_sq``). Every rank runs under ``torchrun --standalone`` with gloo and one torch
thread; the snapshots go into a directory of ``/dev/shm`` made for the run (``DIST_RESUME_SHM_DIR``), the folders
into a temporary directory on the local disk (``--dir``); both are removed at the end.

1. **Stall** at 1 and 2 ranks, medians of ``--rounds`` interleaved rounds, each call timed from a barrier to its
   return on every rank, the slowest rank counted: ``snapshot(step)`` against a plain copy of the same tensor bytes
   into a preallocated, pre-touched buffer (the limit), a synchronous ``save(step)`` and the return of
   ``save_async(step)`` (into another folder), and ``save(step)`` right after ``snapshot(step)`` (the background
   copy's stall). Two steps between the copy and the snapshot show what the snapshot no longer does: the same bytes
   written into a new file in shared memory, and ``torch.save`` of the same state into one. Beside the stall, the
   wait from ``snapshot``'s return to the end of its commit in the background (the CRC-32s and the commit record:
   until then the previous snapshot is the newest), and the first round's snapshot (new slot files) on its own. The
   plain copy is the node's local rank 0 copying every byte while the other ranks wait; ``snapshot`` splits the copy
   across the node's ranks (each its share of the parameters and the AdamW state), so beside it: the plain copy split
   the same way (each rank copying alternate tensors into its own buffer) and ``snapshot`` with the copy left to
   local rank 0 alone (the private switch ``dist_resume._manager.snapshots.split.writer_only``, another folder).
2. **Restart** to the first step after a worker is SIGKILLed, 2 ranks under ``torchrun --max-restarts=1``: a loop
   that snapshots every step and saves every ``--save-every`` steps, against one that saves every ``--save-every``
   steps alone (the folder on the local disk). Rank 1 kills itself after step ``2 * save_every - 1``, between two
   saves; torchrun stops rank 0 (SIGTERM) and restarts both. The workers write timestamps: the kill, the restarted
   workers' start, their ``resume()``'s return and every step's end. Steps redone: those the restart ran again.
   A store throttled to a fixed bandwidth is not measured.
3. **Shared memory held** per node (``dist_resume._shm.held_bytes``: both slots and every part) over the state's
   size, after two snapshots, at 1, 2 and 4 ranks (4 ranks: ``--held-ranks``), and what a clean ``close()`` leaves.

``--per-call`` measures instead what one ``snapshot(step)`` costs against a plain copy at small and large states
(``--per-call-sizes``, 24 and 384 MiB) and 1, 2 and 4 ranks (``--per-call-ranks``), with the stages of the call on
rank 0: scripts/_bench_memory_calls.py.

Prints a table and a JSON document (``--json-out FILE`` keeps it).

    python scripts/bench_memory.py                  # 1 GiB: 4.3 min of CPU, 7 min on 2 busy cores; ~8 GiB of RAM
    python scripts/bench_memory.py --quick          # 128 MiB, 2 rounds: about 2 minutes on 2 busy cores
    python scripts/bench_memory.py --size-mib 256 --rounds 5 --json-out memory.json
    python scripts/bench_memory.py --stall-only --rounds 9   # 1. alone: a few minutes
    python scripts/bench_memory.py --per-call --rounds 15    # per call at 24 and 384 MiB, 1, 2, 4 ranks: ~4 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench_memory_calls import calls_table, calls_worker

ROLE_ENV = "BENCH_MEMORY_ROLE"
SHM_ENV = "DIST_RESUME_SHM_DIR"  # dist_resume._shm.SHM_DIR_ENV (the parent does not import torch)
LAYERS = 4
STALL_OPS = (
    "plain copy",
    "plain copy, split",
    "snapshot, writer alone",
    "write to a new shm file",
    "torch.save to a new shm file",
    "snapshot",
    "commit after snapshot",
    "save after snapshot",
    "save",
    "save_async",
)

# --- what every worker builds ---


def _width(size_mib: float) -> int:
    """The side of each square Linear so that weights + exp_avg + exp_avg_sq come to ``size_mib``."""
    return max(8, round(math.sqrt(size_mib * 2**20 / (3 * 4 * LAYERS))))


def _build(size_mib: float, *, with_state: bool) -> tuple[Any, Any, int]:
    """A DDP model of LAYERS Linear(d, d) with ReLUs and its AdamW (its state filled when ``with_state``), and d."""
    import torch
    from torch import nn

    d = _width(size_mib)
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(LAYERS):
        layers += [nn.Linear(d, d, bias=False)] + ([nn.ReLU()] if i < LAYERS - 1 else [])
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    if with_state:  # the state a step leaves, without a backward's all-reduce
        for p in model.parameters():
            p.grad = torch.full_like(p, 1e-3)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt, d


def _state_tensors(model: Any, opt: Any) -> list[Any]:
    import torch

    tensors = list(model.state_dict().values())
    for state in opt.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return tensors


def _bytes_of(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


# --- 1. the stall, and 3. the memory held ---


def _stall_worker(cfg: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._manager.snapshots import split
    from dist_resume._shm import held_bytes, store_dir

    dr.init_distributed()
    dr.set_verbosity("warning")  # no line per save
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = int(os.environ.get("LOCAL_RANK", "0")) == 0
    model, opt, _ = _build(cfg["size_mib"], with_state=True)
    tensors = _state_tensors(model, opt)
    state_bytes = sum(t.numel() * t.element_size() for t in tensors)
    snap_folder = os.path.join(cfg["dir"], "snap")
    snap = dr.CheckpointManager(snap_folder, model=model, optimizer=opt, keep_last=1)
    solo = dr.CheckpointManager(os.path.join(cfg["dir"], "solo"), model=model, optimizer=opt, keep_last=1)
    saver = dr.CheckpointManager(os.path.join(cfg["dir"], "save"), model=model, optimizer=opt, keep_last=1)
    mine = tensors[rank::world]  # the split plain copy: alternate tensors (equal sizes here), each into its own buffer
    mine_bytes = sum(t.numel() * t.element_size() for t in mine)
    buffer = torch.ones(max(state_bytes if writer else 0, mine_bytes), dtype=torch.uint8)  # pre-touched
    scratch = Path(os.environ[SHM_ENV]) / f"bench_memory.scratch.{os.getpid()}"

    def copy_into_buffer(some: list[Any]) -> None:
        offset = 0
        for t in some:
            flat = _bytes_of(t)
            buffer[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()

    def plain_copy() -> None:
        if writer:
            copy_into_buffer(tensors)

    def snapshot_alone(step: int) -> None:
        split.writer_only = True
        try:
            solo.snapshot(step)
        finally:
            split.writer_only = False

    def write_file() -> None:
        if writer:
            with open(scratch, "wb", buffering=0) as f:
                for t in tensors:
                    f.write(memoryview(_bytes_of(t).numpy()))

    def torch_save() -> None:
        if writer:
            with open(scratch, "wb", buffering=0) as f:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, f)

    times: dict[str, list[float]] = {name: [] for name in STALL_OPS}

    def timed(name: str, fn: Callable[..., object], *args: object) -> object:
        dist.barrier()
        start = time.perf_counter()
        out = fn(*args)
        dist.barrier()  # every rank waits for the node's writer, as every rank waits in snapshot()
        times[name].append(time.perf_counter() - start)
        return out

    for round_ in range(cfg["rounds"]):
        step = round_ + 1
        timed("write to a new shm file", write_file)
        scratch.unlink(missing_ok=True)
        timed("torch.save to a new shm file", torch_save)
        scratch.unlink(missing_ok=True)
        timed("plain copy", plain_copy)  # right before the snapshots: all in the same state of the machine
        timed("plain copy, split", copy_into_buffer, mine)
        timed("snapshot, writer alone", snapshot_alone, step)
        if writer:
            solo._memory._join_commit(raising=True)  # its CRC-32s not left running beside the next call
        dist.barrier()
        timed("snapshot", snap.snapshot, step)
        # the writer's commit (CRC-32s, record) runs on after snapshot() returned: until it ends, the snapshot does
        # not count; timed from the return (plus a barrier) to its end
        timed("commit after snapshot", lambda: snap._memory._join_commit(raising=True) if writer else None)
        timed("save after snapshot", snap.save, step)
        snap._memory._join_copy()  # rank 0's background copy ends before the next call is timed (snapshot() waits too)
        timed("save", saver.save, 2 * step)
        handle: Any = timed("save_async", saver.save_async, 2 * step + 1)
        handle.wait()
    held = held_bytes(snap.folder) if writer else 0
    store = store_dir(snap.folder)
    snap.close()
    solo.close()
    saver.close()
    left = held_bytes(snap.folder) if writer else 0
    store_left = store is not None and store.exists() and any(store.iterdir())
    slowest: list[dict[str, list[float]]] = [{} for _ in range(world)]
    dist.all_gather_object(slowest, times)
    if rank == 0:
        result = {
            "ranks": world,
            "state_bytes": state_bytes,
            "rounds": {n: [max(r[n][i] for r in slowest) for i in range(cfg["rounds"])] for n in STALL_OPS},
            "held_bytes": held,
            "held_after_close": left,
            "store_files_after_close": bool(store_left),
        }
        Path(cfg["out"]).write_text(json.dumps(result))
    dr.destroy_distributed()


def _held_worker(cfg: dict[str, Any]) -> None:
    """3. at more ranks than the stall runs: two snapshots, the bytes held, close()."""
    import torch.distributed as dist

    import dist_resume as dr
    from dist_resume._shm import held_bytes

    dr.init_distributed()
    dr.set_verbosity("warning")
    model, opt, _ = _build(cfg["size_mib"], with_state=True)
    state_bytes = sum(t.numel() * t.element_size() for t in _state_tensors(model, opt))
    folder = os.path.join(cfg["dir"], "held")
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt, keep_last=1)
    mgr.snapshot(1)
    mgr.snapshot(2)
    dist.barrier()
    held = held_bytes(mgr.folder)
    mgr.close()
    left = held_bytes(mgr.folder)
    if dist.get_rank() == 0:
        result = {
            "ranks": dist.get_world_size(),
            "state_bytes": state_bytes,
            "held_bytes": held,
            "held_after_close": left,
        }
        Path(cfg["out"]).write_text(json.dumps(result))
    dr.destroy_distributed()


# --- 2. the restart ---


def _train_worker(cfg: dict[str, Any]) -> None:
    started = time.time()  # before torch is imported: the restarted worker's start
    import torch
    import torch.distributed as dist

    import dist_resume as dr

    dr.init_distributed()
    dr.set_verbosity("warning")
    rank = dist.get_rank()
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = cfg["folder"]
    log = Path(f"{folder}.times_{rank}")

    def note(*fields: object) -> None:
        with log.open("a") as f:
            f.write(" ".join(map(str, (generation, *fields))) + "\n")

    note("start", started)
    model, opt, d = _build(cfg["size_mib"], with_state=False)
    mgr = dr.CheckpointManager(folder, model=model, optimizer=opt, keep_last=2)
    result = mgr.resume()
    step = result.step if result is not None and result.step is not None else 0
    note("resumed", time.time(), step, None if result is None else result.source)
    x = torch.randn(8, d, generator=torch.Generator().manual_seed(rank))
    save_every, kill_at = cfg["save_every"], 2 * cfg["save_every"] - 1
    while step < 2 * cfg["save_every"]:
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
        note("step", time.time(), step)
        if cfg["memory"]:
            mgr.snapshot(step)
        if step % save_every == 0:
            mgr.save(step)
        if step == kill_at and rank == 1 and generation == 0:
            Path(f"{folder}.killed").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
    mgr.close()
    dr.destroy_distributed()


def _restart_figures(folder: str, save_every: int) -> dict[str, Any]:
    """From rank 0's timestamps: the restart's phases from the kill, the steps redone, where it resumed from."""
    killed = float(Path(f"{folder}.killed").read_text())
    lines = [line.split() for line in Path(f"{folder}.times_0").read_text().splitlines()]
    gen1 = [fields[1:] for fields in lines if fields[0] == "1"]
    start = next(float(f[1]) for f in gen1 if f[0] == "start")
    resumed = next(f for f in gen1 if f[0] == "resumed")
    steps = [(int(f[2]), float(f[1])) for f in gen1 if f[0] == "step"]
    kill_at = 2 * save_every - 1
    gen0_steps = [float(f[2]) for f in lines if f[0] == "0" and f[1] == "step"]
    return {
        "killed_after_step": kill_at,
        "resumed_step": int(resumed[2]),
        "source": resumed[3],
        "kill_to_worker_start_s": start - killed,
        "kill_to_resumed_s": float(resumed[1]) - killed,
        "kill_to_first_step_s": steps[0][1] - killed,
        "kill_to_new_step_s": next(t for s, t in steps if s == kill_at + 1) - killed,
        "steps_redone": sum(1 for s, _ in steps if s <= kill_at),
        "step_period_before_kill_s": statistics.median(b - a for a, b in itertools.pairwise(gen0_steps)),
    }


# --- the parent ---


def _launch(cfg: dict[str, Any], role: str, ranks: int, log: Path, *, restarts: int = 0, timeout: float) -> None:
    env = {**os.environ, ROLE_ENV: role, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    if restarts:
        cmd.append(f"--max-restarts={restarts}")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, __file__, json.dumps(cfg)], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = -9
    if rc != 0:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise SystemExit(f"{role} at {ranks} ranks failed (exit status {rc}); the output's end is above")


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def _x(ratio: float) -> str:
    return f"{ratio:.2f}×" if ratio >= 0.1 else f"{ratio:.3f}×"


def _table(doc: dict[str, Any]) -> str:
    rows = ["| # | what | dist_resume | compared with | ratio |", "|---|---|---|---|---|"]
    for ranks, run in doc["stall"].items():
        med = run["median_s"]
        snap = med["snapshot"]
        pairs = [
            ("plain copy", "≤ 1.25× goal"),
            ("snapshot, writer alone", ""),
            ("plain copy, split", ""),
            ("write to a new shm file", ""),
            ("torch.save to a new shm file", ""),
            ("save", ""),
            ("save_async", ""),
        ]
        rounds = run["rounds"]
        for i, (other, note) in enumerate(pairs):
            what = f"stall, {ranks} rank{'s' if ranks != '1' else ''}" if i == 0 else ""
            mark = "" if not note else (" ✅" if snap <= 1.25 * med[other] else " ❌")
            paired = statistics.median(a / b for a, b in zip(rounds["snapshot"], rounds[other], strict=True))
            each = f" (median of the rounds' own ratios {_x(paired)})" if i < 3 else ""
            rows.append(
                f"| {'1' if i == 0 and ranks == '1' else ''} | {what} | snapshot {_ms(snap)} | "
                f"{other} {_ms(med[other])} | {_x(snap / med[other])}{mark}{each} |"
            )
        first = run["rounds"]["snapshot"][0]
        rows.append(
            f"| | | first snapshot (new slot files) {_ms(first)} | plain copy {_ms(med['plain copy'])} | "
            f"{_x(first / med['plain copy'])} |"
        )
        rows.append(
            f"| | | commit ends {_ms(med['commit after snapshot'])} after snapshot returned (background) | "
            f"plain copy {_ms(med['plain copy'])} | {_x(med['commit after snapshot'] / med['plain copy'])} |"
        )
        rows.append(
            f"| | | save after snapshot {_ms(med['save after snapshot'])} | save {_ms(med['save'])} | "
            f"{_x(med['save after snapshot'] / med['save'])} |"
        )
    if "restart" not in doc:  # --stall-only
        return "\n".join(rows)
    mem, disk = doc["restart"]["memory"], doc["restart"]["folder"]
    for i, (key, what) in enumerate(
        [
            ("kill_to_first_step_s", "kill → first step after the restart"),
            ("kill_to_new_step_s", f"kill → step {mem['killed_after_step'] + 1} done (past the kill)"),
            ("kill_to_resumed_s", "kill → resume() returned"),
            ("kill_to_worker_start_s", "kill → restarted worker started"),
        ]
    ):
        rows.append(
            f"| {'2' if i == 0 else ''} | {what}, 2 ranks | memory {_ms(mem[key])} | folder {_ms(disk[key])} | "
            f"{_x(mem[key] / disk[key])} |"
        )
    rows.append(
        f"| | steps redone | memory {mem['steps_redone']} (resumed at {mem['resumed_step']}, {mem['source']}) | "
        f"folder {disk['steps_redone']} (resumed at {disk['resumed_step']}, {disk['source']}) | |"
    )
    rows.append(
        f"| | step period before the kill | memory {_ms(mem['step_period_before_kill_s'])} | "
        f"folder {_ms(disk['step_period_before_kill_s'])} | "
        f"{_x(mem['step_period_before_kill_s'] / disk['step_period_before_kill_s'])} |"
    )
    for i, held in enumerate(doc["held"]):
        excess = (held["held_bytes"] - 2 * held["state_bytes"]) / 2**10
        rows.append(
            f"| {'3' if i == 0 else ''} | /dev/shm per node, {held['ranks']} rank{'s' if held['ranks'] > 1 else ''}, "
            f"two snapshots | {held['held_bytes'] / 2**20:,.1f} MiB | state {held['state_bytes'] / 2**20:,.1f} MiB | "
            f"{held['held_bytes'] / held['state_bytes']:.4f}× (two copies {excess:+,.0f} KiB); "
            f"after close(): {held['held_after_close']} B |"
        )
    return "\n".join(rows)


def _per_call(args: argparse.Namespace) -> None:
    """``--per-call``: one launch per (state, ranks); the table of scripts/_bench_memory_calls.py."""
    rounds = 15 if args.rounds == 3 else args.rounds  # the stall's default of 3 is too few for milliseconds
    shm = tempfile.mkdtemp(prefix="bench_memory.", dir="/dev/shm")
    os.environ[SHM_ENV] = shm
    began = time.perf_counter()
    runs = []
    try:
        with tempfile.TemporaryDirectory(prefix="bench_memory.", dir=args.dir) as tmp:
            for size in args.per_call_sizes:
                for ranks in args.per_call_ranks:
                    print(f"per call: {size:g} MiB at {ranks} rank(s) ...", file=sys.stderr, flush=True)
                    out = Path(tmp) / f"calls_{size:g}_{ranks}.json"
                    cfg = {
                        "size_mib": size,
                        "rounds": rounds,
                        "warmup": 3,
                        "dir": os.path.join(tmp, "calls"),
                        "out": str(out),
                    }
                    _launch(cfg, "calls", ranks, Path(tmp) / f"calls_{size:g}_{ranks}.log", timeout=600)
                    runs.append(json.loads(out.read_text()))
        left = sorted(p.name for p in Path(shm).iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    print(
        f"\nmedians of {rounds} rounds (3 more first, left out), {time.perf_counter() - began:.0f} s in all; "
        f"left in shared memory after the runs: {left or 'nothing'}; stages in ms, on rank 0\n"
    )
    print(calls_table(runs))
    text = json.dumps({"per_call": runs}, indent=2)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


def main() -> None:
    role = os.environ.get(ROLE_ENV)
    if role == "calls":
        calls_worker(json.loads(sys.argv[1]), _build, _state_tensors)
        return
    if role:
        {"stall": _stall_worker, "held": _held_worker, "train": _train_worker}[role](json.loads(sys.argv[1]))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=1024, help="model + AdamW state (default 1024)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the stall (default 3)")
    p.add_argument("--save-every", type=int, default=3, help="the restart's save interval (default 3)")
    p.add_argument("--held-ranks", type=int, nargs="*", default=[4], help="more ranks for 3. (default 4)")
    p.add_argument("--quick", action="store_true", help="128 MiB, 2 rounds: a smoke run of about a minute")
    p.add_argument("--stall-only", action="store_true", help="1. alone (and 3. at 1 and 2 ranks)")
    p.add_argument("--dir", default=None, help="where the folders go (default: the temporary directory)")
    p.add_argument("--per-call", action="store_true", help="what one snapshot costs, against a plain copy (see above)")
    p.add_argument("--per-call-sizes", type=float, nargs="*", default=[24, 384], help="states in MiB (24 384)")
    p.add_argument("--per-call-ranks", type=int, nargs="*", default=[1, 2, 4], help="rank counts (1 2 4)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.per_call:
        _per_call(args)
        return
    if args.quick:
        args.size_mib, args.rounds = 128, 2
    if args.save_every < 2:
        p.error("--save-every must be at least 2: the kill falls between two saves")
    shm = tempfile.mkdtemp(prefix="bench_memory.", dir="/dev/shm")
    os.environ[SHM_ENV] = shm
    began = time.perf_counter()
    doc: dict[str, Any] = {"size_mib": args.size_mib, "rounds": args.rounds, "stall": {}, "held": []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench_memory.", dir=args.dir) as tmp:
            base = {"size_mib": args.size_mib, "rounds": args.rounds}
            timeout = 120 + 0.5 * args.size_mib
            for ranks in (1, 2):
                print(f"stall at {ranks} rank(s) ...", file=sys.stderr, flush=True)
                out = Path(tmp) / f"stall_{ranks}.json"
                cfg = {**base, "dir": os.path.join(tmp, f"stall_{ranks}"), "out": str(out)}
                _launch(cfg, "stall", ranks, Path(tmp) / f"stall_{ranks}.log", timeout=timeout)
                run = json.loads(out.read_text())
                run["median_s"] = {n: statistics.median(v) for n, v in run["rounds"].items()}
                doc["stall"][str(ranks)] = run
                doc["held"].append({k: run[k] for k in ("ranks", "state_bytes", "held_bytes", "held_after_close")})
            for ranks in [] if args.stall_only else args.held_ranks:
                print(f"shared memory held at {ranks} ranks ...", file=sys.stderr, flush=True)
                out = Path(tmp) / f"held_{ranks}.json"
                cfg = {**base, "dir": os.path.join(tmp, f"held_{ranks}"), "out": str(out)}
                _launch(cfg, "held", ranks, Path(tmp) / f"held_{ranks}.log", timeout=timeout)
                doc["held"].append(json.loads(out.read_text()))
            for kind in [] if args.stall_only else ["memory", "folder"]:
                print(f"restart after a SIGKILL, {kind} ...", file=sys.stderr, flush=True)
                folder = os.path.join(tmp, f"restart_{kind}")
                cfg = {**base, "folder": folder, "save_every": args.save_every, "memory": kind == "memory"}
                _launch(cfg, "train", 2, Path(tmp) / f"restart_{kind}.log", restarts=1, timeout=2 * timeout)
                doc.setdefault("restart", {})[kind] = _restart_figures(folder, args.save_every)
            leftover = sorted(p.name for p in Path(shm).iterdir())
            doc["shm_left_after_runs"] = leftover
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    doc["state_mib"] = doc["stall"]["1"]["state_bytes"] / 2**20
    doc["wall_s"] = time.perf_counter() - began
    print(
        f"\nstate {doc['state_mib']:.0f} MiB (model {LAYERS} x Linear({_width(args.size_mib)}, "
        f"{_width(args.size_mib)}) + AdamW), medians of {args.rounds} rounds, {doc['wall_s']:.0f} s in all; "
        f"left in shared memory after the runs: {doc['shm_left_after_runs'] or 'nothing'}\n"
    )
    print(_table(doc))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
