#!/usr/bin/env python
"""A restart after a worker's SIGKILL, and goodput under failures, with snapshots in host memory (issue 37).

Every run is ``torchrun --standalone --nproc_per_node=2 --max-restarts=R`` of scripts/_bench_restart_worker.py, a
training script written as users write one: a DDP model of four square ``Linear`` layers with AdamW (weights,
``exp_avg`` and ``exp_avg_sq``: ``--size-mib`` in all), gloo on the CPU, one torch thread per rank, a ``DataLoader``
over a ``ResumableDistributedSampler``, and a ``CheckpointManager`` that resumes, snapshots every step
(``snapshot(step)``) and saves every ``--save-every`` steps, or saves alone (snapshots off: the same script). Rank 1
SIGKILLs itself after chosen steps; torchrun stops rank 0 (SIGTERM) and restarts both. Each run gets its own
``DIST_RESUME_SHM_DIR`` (a new directory of ``/dev/shm``) and folder, removed afterwards.

1. **Restart to the first step** after the kill, four cases side by side: from memory (snapshots on: the snapshot is
   newer than the folder) against from the folder (snapshots off: the last save), the folder on the local disk and
   on a throttled store. One launch per case with ``--max-restarts=--rounds``: the first kill after step
   ``--kill-at`` (between the saves), each later one 5 steps after the previous one from memory (where the restart
   resumed), 1 step after it from the folder (the restart resumed at the last save and must reach a step past its
   kill: rounds redo 5, 6, ... steps). Per round, from the workers' timestamps (rank 1's kill, rank 0's events): the
   kill → the restarted workers' start, ``resume()``'s return, the first step's end, the end of the first step past
   the kill; the steps redone. Medians of the rounds.

   **The throttled store** is an S3 bucket on moto's server (the tests' S3 server), run in this process on 127.0.0.1,
   reached only through a proxy, also in this process, that passes every byte at ``--bandwidth-mib`` MiB/s per
   direction, shared by all connections (one token bucket for the bytes to the store, one for those from it): every
   request of the workers (the folder's listing, the lease, the CRC-32 check of the newest object, the ranged reads
   of a resume, the multipart uploads of a save and of the snapshot copied into the folder) crosses that link.
   ``s3://`` URLs with ``AWS_ENDPOINT_URL`` pointing at the proxy, as a user points s3fs at MinIO.
2. **Goodput**: ``--steps`` steps with rank 1 killed after step K, 2K, ... (``--kill-every``; each kill once), under
   ``--max-restarts`` = the number of kills, snapshots every step + a save every ``--save-every`` against saves alone,
   on the local disk, at each of ``--goodput-size-mib`` (one or more states) with its ``--step-time`` (each step padded
   to that many seconds: the compute of a real job's step at that size, on an accelerator); beside them the same two
   runs with no kill. Wall time of the launch (torchrun's start to its exit) over the failure-free saves-alone run's,
   and over each configuration's own failure-free run; the steps run in all; the snapshot's cost per step (the step
   period with snapshots over the one without, failure-free). ``--goodput-only`` skips 1.

Prints the table and a JSON document (``--json-out FILE`` keeps it).

    python scripts/bench_restart.py                 # 256 MiB restart, 32 MiB goodput: about 10 min on 2 busy cores
    python scripts/bench_restart.py --quick         # 32 MiB, 1 round, short loops: a smoke run of about 3.5 min
    python scripts/bench_restart.py --rounds 3 --bandwidth-mib 64 --json-out restart.json
    python scripts/bench_restart.py --goodput-only --goodput-size-mib 32 128 512 --step-time 0.05 0.2 0.8 \
        --steps 60 --save-every 25 --kill-every 20      # goodput at three sizes: about 10 min
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

WORKER = str(Path(__file__).with_name("_bench_restart_worker.py"))
SHM_ENV = "DIST_RESUME_SHM_DIR"  # dist_resume._shm.SHM_DIR_ENV (the parent does not import torch)
REDO_GAP = 5  # a later round's kill: this many steps after the restart's resume point

# --- the throttled store: moto's S3 server behind a proxy that passes a fixed bandwidth ---


class _Link:
    """One direction of a link of ``rate`` bytes/s shared by every connection: each chunk waits its turn."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.free_at = 0.0
        self.lock = threading.Lock()
        self.bytes = 0

    def take(self, n: int) -> None:
        with self.lock:
            now = time.monotonic()
            start = max(now, self.free_at)
            self.free_at = start + n / self.rate
            self.bytes += n
        time.sleep(max(0.0, self.free_at - now))


def _pump(src: socket.socket, dst: socket.socket, link: _Link) -> None:
    try:
        while chunk := src.recv(64 * 1024):
            link.take(len(chunk))
            dst.sendall(chunk)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _ThrottledProxy:
    """A TCP proxy on 127.0.0.1 to ``target``: ``up`` carries the client's bytes, ``down`` the server's."""

    def __init__(self, target: tuple[str, int], rate: float) -> None:
        self.target = target
        self.up, self.down = _Link(rate), _Link(rate)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(self.target)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=_pump, args=(client, upstream, self.up), daemon=True).start()
            threading.Thread(target=_pump, args=(upstream, client, self.down), daemon=True).start()

    def close(self) -> None:
        self.server.close()


@contextmanager
def _throttled_s3(rate_mib: float) -> Iterator[tuple[dict[str, str], _ThrottledProxy]]:
    """moto's S3 server and the proxy in front of it; yields the workers' environment (endpoint, dummy keys)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    proxy = _ThrottledProxy(server.get_host_and_port(), rate_mib * 2**20)
    try:
        yield (
            {
                "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}",
                "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1",
            },
            proxy,
        )
    finally:
        proxy.close()
        server.stop()


def _new_bucket(env: dict[str, str]) -> str:
    import boto3

    name = f"bench-restart-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    ).create_bucket(Bucket=name)
    return f"s3://{name}"


# --- one launch ---


def _launch(
    folder: str, times: Path, args: list[str], *, restarts: int, env: dict[str, str], log: Path, timeout: float
) -> float:
    """torchrun of the worker; returns the launch's wall time. Kills the whole tree on timeout."""
    from dist_resume.testing import kill_tree

    times.mkdir(parents=True)
    shm = tempfile.mkdtemp(prefix="bench_restart.", dir="/dev/shm")
    full_env = {**os.environ, **env, SHM_ENV: shm, "OMP_NUM_THREADS": "1"}
    full_env.pop("AWS_PROFILE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [f"--max-restarts={restarts}", WORKER, folder, "--times", str(times), *args]
    try:
        with log.open("wb") as out:
            start = time.perf_counter()
            proc = subprocess.Popen(cmd, env=full_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc.pid)
                proc.wait()
                rc = -9
            wall = time.perf_counter() - start
        left = sorted(p.name for p in Path(shm).iterdir())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    if rc != 0:
        sys.stderr.write(log.read_text(errors="replace")[-4000:])
        raise SystemExit(f"{' '.join(args)} failed (exit status {rc}, after {wall:.0f} s); the output's end is above")
    if left:
        print(f"  left in shared memory after a clean end: {left}", file=sys.stderr)
    return wall


def _events(times: Path, rank: int) -> list[tuple[int, str, float, list[str]]]:
    out = []
    for line in (times / f"times_{rank}").read_text().splitlines():
        gen, event, when, *rest = line.split()
        out.append((int(gen), event, float(when), rest))
    return out


def _restart_rounds(times: Path) -> list[dict[str, Any]]:
    """Per restart: its phases from the kill (rank 1's timestamp; rank 0's start, resume and steps)."""
    kills = {g: (t, int(r[0])) for g, e, t, r in _events(times, 1) if e == "killed"}
    ev = _events(times, 0)
    rounds = []
    for gen, (killed, kill_step) in sorted(kills.items()):
        mine = [(e, t, r) for g, e, t, r in ev if g == gen + 1]
        resumed = next((t, r) for e, t, r in mine if e == "resumed")
        steps = [(int(r[0]), t) for e, t, r in mine if e == "step"]
        before = [t for g, e, t, _ in ev if g == gen and e == "step"]
        rounds.append(
            {
                "killed_after_step": kill_step,
                "resumed_step": int(resumed[1][0]),
                "source": resumed[1][1],
                "kill_to_worker_start_s": next(t for e, t, _ in mine if e == "start") - killed,
                "kill_to_resumed_s": resumed[0] - killed,
                "kill_to_first_step_s": steps[0][1] - killed,
                "kill_to_past_kill_s": next(t for s, t in steps if s == kill_step + 1) - killed,
                "steps_redone": sum(1 for s, _ in steps if s <= kill_step),
                "step_period_s": statistics.median(b - a for a, b in itertools.pairwise(before)),
            }
        )
    return rounds


def _restart_case(
    name: str, folder: str, tmp: Path, cfg: dict[str, Any], *, memory: bool, env: dict[str, str]
) -> dict[str, Any]:
    first, rounds = cfg["kill_at"], cfg["rounds"]
    # from memory, each later kill REDO_GAP steps past the previous one (where the restart resumes); from the folder,
    # each one step past the previous one, so that every restart (resumed at the last save) reaches a step past its kill
    kills = [first + (REDO_GAP if memory else 1) * i for i in range(rounds)]
    steps = kills[-1] + 2
    args = ["--size-mib", str(cfg["size_mib"]), "--steps", str(steps), "--save-every", str(cfg["save_every"])]
    args += ["--snapshot-every", "1" if memory else "0", "--kill-at", *map(str, kills)]
    times = tmp / f"{name}.times"
    print(f"restart: {name} ({rounds} kill(s), after steps {kills}) ...", file=sys.stderr, flush=True)
    wall = _launch(folder, times, args, restarts=rounds, env=env, log=tmp / f"{name}.log", timeout=cfg["timeout"])
    per_round = _restart_rounds(times)
    keys = [k for k in per_round[0] if k.endswith("_s") or k == "steps_redone"]
    return {
        "wall_s": wall,
        "rounds": per_round,
        "median": {k: statistics.median(r[k] for r in per_round) for k in keys},
        "sources": sorted({r["source"] for r in per_round}),
    }


def _goodput_case(
    name: str, tmp: Path, cfg: dict[str, Any], *, size: float, step_time: float, memory: bool, kills: list[int]
) -> dict[str, Any]:
    args = ["--size-mib", str(size), "--steps", str(cfg["steps"]), "--step-time", str(step_time)]
    args += ["--save-every", str(cfg["save_every"]), "--snapshot-every", "1" if memory else "0"]
    args += ["--kill-at", *map(str, kills)]
    times = tmp / f"{name}.times"
    print(f"goodput: {name} ...", file=sys.stderr, flush=True)
    wall = _launch(
        str(tmp / name), times, args, restarts=len(kills), env={}, log=tmp / f"{name}.log", timeout=cfg["timeout"]
    )
    ev = _events(times, 0)
    sources = [r[1] for _, e, _, r in ev if e == "resumed"][1:]
    return {
        "wall_s": wall,
        "kills": kills,
        "steps_run": sum(1 for _, e, _, _ in ev if e == "step"),
        "restarts_from": sources,
        "step_period_s": statistics.median(
            b - a for (ga, ea, a, _), (gb, eb, b, _) in itertools.pairwise(ev) if ea == eb == "step" and ga == gb
        ),
    }


# --- the report ---


def _s(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x < 1 else f"{x:.2f} s"


def _table(doc: dict[str, Any]) -> str:
    r = doc["restart"]
    rows = [
        "| restart, median of the rounds | local disk: memory | local disk: folder | ratio | "
        f"S3 at {doc['bandwidth_mib']:g} MiB/s: memory | S3: folder | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, what in [
        ("kill_to_worker_start_s", "kill → restarted workers started"),
        ("kill_to_resumed_s", "kill → `resume()` returned"),
        ("kill_to_first_step_s", "**kill → first step done**"),
        ("kill_to_past_kill_s", "kill → first step past the kill done"),
        ("step_period_s", "step period before the kill"),
    ]:
        cells = []
        for store in ("local", "s3"):
            mem, fold = r[f"{store}_memory"]["median"][key], r[f"{store}_folder"]["median"][key]
            cells += [_s(mem), _s(fold), f"{mem / fold:.2f}×"]
        rows.append(f"| {what} | {' | '.join(cells)} |")
    cells = []
    for store in ("local", "s3"):
        for kind in ("memory", "folder"):
            case = r[f"{store}_{kind}"]
            cells.append(f"{case['median']['steps_redone']:g} ({', '.join(case['sources'])})")
        cells.append("")
    rows.append(f"| steps redone (resumed from) | {' | '.join(cells)} |")
    rows.append("")
    spread = "; ".join(
        f"{name}: {', '.join(_s(x['kill_to_first_step_s']) for x in case['rounds'])}" for name, case in r.items()
    )
    rows.append(f"kill → first step, each round: {spread}")
    rows.append("")
    return "\n".join(rows)


def _goodput_table(doc: dict[str, Any]) -> str:
    rows = [
        "| state, step | goodput | wall | over saves alone, no kill | over its own no-kill run | steps run | step period |",
        "|---|---|---|---|---|---|---|",
    ]
    for size, g in doc["goodput"].items():
        base = g["folder_no_kill"]["wall_s"]
        per_step = g["memory_no_kill"]["step_period_s"] / g["folder_no_kill"]["step_period_s"]
        for i, (name, what) in enumerate(
            [
                ("folder_no_kill", "saves alone, no kill"),
                ("memory_no_kill", f"snapshot every step + saves, no kill (a step {per_step:.2f}× as long)"),
                ("folder_kills", f"saves alone, killed after {g['folder_kills']['kills']}"),
                ("memory_kills", "snapshot every step + saves, the same kills"),
            ]
        ):
            case = g[name]
            own = g[name.replace("kills", "no_kill")]["wall_s"]
            head = f"{size} MiB, {g['step_time_s']:g} s" if i == 0 else ""
            rows.append(
                f"| {head} | {what} | {case['wall_s']:.1f} s | {case['wall_s'] / base:.2f}× | "
                f"{case['wall_s'] / own:.2f}× | {case['steps_run']} | {_s(case['step_period_s'])} |"
            )
    return "\n".join(rows)
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mib", type=float, default=256, help="the restart's model + AdamW state (default 256)")
    p.add_argument("--save-every", type=int, default=50, help="the save interval (default 50)")
    p.add_argument("--kill-at", type=int, default=55, help="the restart's first kill, after this step (default 55)")
    p.add_argument("--rounds", type=int, default=2, help="restarts per restart case (default 2)")
    p.add_argument("--bandwidth-mib", type=float, default=32, help="the store's link, per direction (default 32)")
    p.add_argument(
        "--goodput-size-mib", type=float, nargs="*", default=[32], help="goodput's model + AdamW states (default 32)"
    )
    p.add_argument(
        "--step-time", type=float, nargs="*", default=[0.0], help="goodput: each state's step, padded to (seconds)"
    )
    p.add_argument("--goodput-only", action="store_true", help="2. alone")
    p.add_argument("--steps", type=int, default=200, help="goodput's run length (default 200)")
    p.add_argument("--kill-every", type=int, default=40, help="goodput's kills: after K, 2K, ... (default 40)")
    p.add_argument("--quick", action="store_true", help="32 MiB, 1 round, save every 5, 20 steps: a smoke run")
    p.add_argument("--dir", default=None, help="where the local folders go (default: the temporary directory)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args()
    if args.quick:
        args.size_mib, args.goodput_size_mib = 32, [32]
        args.rounds, args.save_every, args.kill_at, args.steps, args.kill_every = 1, 5, 6, 20, 8
    if args.kill_at % args.save_every == 0 or args.kill_at < args.save_every:
        p.error("--kill-at must fall between two saves, after the first")
    kills = list(range(args.kill_every, args.steps, args.kill_every))
    if any(k % args.save_every == 0 for k in kills):
        p.error("goodput's kills must fall between saves: pick --kill-every so no multiple is one of --save-every")
    if len(args.step_time) == 1:
        args.step_time = args.step_time * len(args.goodput_size_mib)
    if len(args.step_time) != len(args.goodput_size_mib):
        p.error("give one --step-time, or one for each --goodput-size-mib")
    cfg: dict[str, Any] = {k: v for k, v in vars(args).items() if k not in ("quick", "dir", "json_out")}
    cfg["timeout"] = 600.0
    doc: dict[str, Any] = {**cfg, "restart": {}, "goodput": {}}
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_restart.", dir=args.dir) as tmp_name:
        tmp = Path(tmp_name)
        if not args.goodput_only:
            with _throttled_s3(args.bandwidth_mib) as (s3_env, proxy):
                for store in ("local", "s3"):  # memory and folder interleaved within each store
                    for kind in ("memory", "folder"):
                        name = f"{store}_{kind}"
                        folder = str(tmp / name) if store == "local" else f"{_new_bucket(s3_env)}/run"
                        env = s3_env if store == "s3" else {}
                        doc["restart"][name] = _restart_case(name, folder, tmp, cfg, memory=kind == "memory", env=env)
                doc["s3_bytes"] = {"to_store": proxy.up.bytes, "from_store": proxy.down.bytes}
        for size, step_time in zip(args.goodput_size_mib, args.step_time):
            runs: dict[str, Any] = {"step_time_s": step_time}
            for name, memory, k in [
                ("folder_no_kill", False, []),
                ("memory_no_kill", True, []),
                ("folder_kills", False, kills),
                ("memory_kills", True, kills),
            ]:
                runs[name] = _goodput_case(
                    f"{name}_{size:g}", tmp, cfg, size=size, step_time=step_time, memory=memory, kills=k
                )
            doc["goodput"][f"{size:g}"] = runs
    doc["wall_s"] = time.perf_counter() - began
    load = os.getloadavg()
    doc["load_average"] = load
    sizes = ", ".join(f"{s:g} MiB ({t:g} s a step)" for s, t in zip(args.goodput_size_mib, args.step_time))
    print(
        f"\nrestart: {args.size_mib:g} MiB state, save every {args.save_every}, first kill after step {args.kill_at}, "
        f"{args.rounds} round(s); goodput: {sizes}, {args.steps} steps, kills after {kills}; "
        f"{doc['wall_s']:.0f} s in all, load average at the end {load[0]:.1f}\n"
    )
    if doc["restart"]:
        print(_table(doc) + "\n")
    print(_goodput_table(doc))
    text = json.dumps(doc, indent=2)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")


if __name__ == "__main__":
    main()
