"""Run under ``torchrun --max-restarts=1`` (2 ranks, gloo, CPU) by tests/dist/test_s3_restart.py against the test
session's S3 server: a job whose first generation dies while rank 0 holds the folder's write lease.

``python s3_restart_worker.py FOLDER_URL``. Each generation resumes a DDP model and its optimizer through a manager on
``FOLDER_URL`` and trains to step :data:`STEPS`, saving every step. In the first generation, once step
:data:`KILL_AFTER` is saved, rank 1 SIGKILLs itself and rank 0 sleeps holding the lease, until torchrun stops it
(SIGTERM: no exit code runs, the lease stays). torchrun restarts the group; its rank 0 takes the lease over at once
(an earlier generation of the same job) and the ranks resume from the bucket and finish. Each rank prints one
``RESULT <json>`` line per generation.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr

STEPS = 4
KILL_AFTER = 2


def _report(out: dict[str, Any]) -> None:
    sys.stdout.write(f"RESULT {json.dumps(out)}\n")  # one write: two ranks' lines never interleave
    sys.stdout.flush()


def main() -> None:
    url = sys.argv[1]
    generation = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    dr.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out: dict[str, Any] = {"rank": rank, "generation": generation, "pid": os.getpid()}
    with dr.CheckpointManager(url, model=model, optimizer=opt, keep_last=2) as mgr:
        result = mgr.resume()
        done = 0 if result is None or result.step is None else result.step
        out["resumed"] = None if result is None else result.step
        out["resumed_at"] = time.time()
        for step in range(done + 1, STEPS + 1):
            g = torch.Generator().manual_seed(10 * step + rank)
            opt.zero_grad()
            model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
            opt.step()
            mgr.save(step)
            if generation == 0 and step == KILL_AFTER:
                out["killed_at"] = time.time()
                _report(out)
                if rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)  # torchrun stops rank 0 and restarts the group
                time.sleep(120)  # rank 0 holds the lease until torchrun's SIGTERM ends it
                raise AssertionError("torchrun did not stop the first generation")
        out["saved"] = [p.name for p in mgr.checkpoints()]
        out["weight"] = model.module.weight.detach().flatten().tolist()
    _report(out)
    dr.destroy_distributed()


if __name__ == "__main__":
    main()
