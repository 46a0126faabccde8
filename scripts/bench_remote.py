#!/usr/bin/env python
"""What a checkpoint folder on an object store costs in requests: counted at a real S3-protocol server.

Starts moto's S3 server on 127.0.0.1 (as the tests do) and counts every HTTP request it answers, by kind (GET of a
byte range, HEAD, LIST, PUT, multipart upload steps, DELETE), while a ``CheckpointManager`` on ``s3://bucket/run``

- saves three checkpoints (``keep_last=2``: the third save rotates the first out),
- resumes in a new manager (choosing the newest: every CRC-32 checked, then the ranged read into the live tensors),
- resumes again with ``cache_dir=`` (the check fills the cache, the read is local), twice, and
- reads the newest with ``dr.resume(file_url)`` alone (no choice: the ranged read only),

each resume as a new process would (nothing of the bucket remembered: no structure read, no CRC-32 checked before),

for a model of ``--mib`` MiB of float32 weights with AdamW state (three times that on the store). Prints a table and
a JSON document.

    python scripts/bench_remote.py                # 64 MiB of weights: about 30 s on 2 busy cores
    python scripts/bench_remote.py --mib 16
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import tempfile
import time
from collections import Counter
from typing import Any

_LINE = re.compile(r'"(?P<method>[A-Z]+) (?P<target>\S+) HTTP/[\d.]+" (?P<status>\d+)')


class _Requests(logging.Handler):
    """Counts the requests moto's server logs (werkzeug's access log), by kind."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.kinds: Counter[str] = Counter()

    def emit(self, record: logging.LogRecord) -> None:
        found = _LINE.search(re.sub(r"\x1b\[[0-9;]*m", "", record.getMessage()))  # werkzeug colours non-200 lines
        if found:
            self.kinds[_kind(found.group("method"), found.group("target"))] += 1

    def take(self) -> dict[str, int]:
        out = dict(sorted(self.kinds.items()))
        self.kinds.clear()
        return out


def _kind(method: str, target: str) -> str:
    if method == "GET" and ("list-type" in target or "prefix=" in target or "delimiter" in target):
        return "LIST"
    if method == "POST" and "uploads" in target and "uploadId" not in target:
        return "create multipart"
    if method == "PUT" and "partNumber" in target:
        return "upload part"
    if method == "POST" and "uploadId" in target:
        return "complete multipart"
    if method == "DELETE" and "uploadId" in target:
        return "abort multipart"
    if method == "POST" and "delete" in target:
        return "DELETE (batch)"
    return method


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="MiB of float32 weights (default 64)")
    args = parser.parse_args()

    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    counter = _Requests()
    access = logging.getLogger("werkzeug")
    access.setLevel(logging.INFO)
    access.addHandler(counter)
    access.propagate = False
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(
        AWS_ENDPOINT_URL=f"http://{host}:{port}",
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    import fsspec
    import torch
    from torch import nn

    import dist_resume as dr
    from dist_resume._source import checked
    from dist_resume._store.ranges import _PIECES, READ_STATS

    fsspec.filesystem("s3").mkdir("bench")
    url = "s3://bench/run"
    width = 1024
    layers = max(1, args.mib * (1 << 20) // (4 * width * width))
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, width)).sum().backward()
    opt.step()
    counter.take()
    rows: list[dict[str, Any]] = []

    def measure(what: str, fn: Any) -> None:
        READ_STATS.reset()
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        kinds = counter.take()
        rows.append(
            {
                "what": what,
                "requests": sum(kinds.values()),
                "kinds": kinds,
                "read_mib": round(READ_STATS.bytes / (1 << 20), 1),
                "ranged_gets": READ_STATS.requests,
                "seconds": round(seconds, 2),
            }
        )

    mgr = dr.CheckpointManager(url, model=model, optimizer=opt, keep_last=2)
    measure("first save (lease taken)", lambda: mgr.save(1))
    measure("second save", lambda: mgr.save(2))
    measure("third save (rotates the first out)", lambda: mgr.save(3))
    measure("close (lease deleted)", mgr.close)
    size = fsspec.filesystem("s3").size(f"{url}/ckpt_00000003.pt")
    live = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
    live_opt = torch.optim.AdamW(live.parameters())

    def forget() -> None:  # what a new process knows of the bucket: nothing (no structure read, no CRC checked)
        _PIECES.clear()
        checked._known.clear()

    def resume(**options: Any) -> None:
        forget()
        with dr.CheckpointManager(url, model=live, optimizer=live_opt, **options) as again:
            again.resume()

    def resume_file() -> None:
        forget()
        dr.resume(f"{url}/ckpt_00000003.pt", model=live, optimizer=live_opt)

    measure("manager resume (choose: every CRC; then ranged read)", resume)
    with tempfile.TemporaryDirectory() as cache:
        measure("manager resume with cache_dir= (first: fills the cache)", lambda: resume(cache_dir=cache))
        measure("manager resume with cache_dir= (again: the cached copy)", lambda: resume(cache_dir=cache))
    measure("dr.resume(file URL) (ranged read only)", resume_file)
    server.stop()
    print(f"checkpoint object: {size / (1 << 20):.1f} MiB ({args.mib} MiB of weights, AdamW state)\n")
    print(f"{'what':58} {'requests':>8} {'read MiB':>9} {'s':>6}  by kind")
    for row in rows:
        kinds = ", ".join(f"{k} {v}" for k, v in row["kinds"].items())
        print(f"{row['what']:58} {row['requests']:>8} {row['read_mib']:>9} {row['seconds']:>6}  {kinds}")
    print(json.dumps({"object_bytes": size, "mib_weights": args.mib, "rows": rows}))


if __name__ == "__main__":
    main()
