"""Run under torchrun (2 ranks, gloo, CPU) by tests/test_s3.py against the test session's S3 server: everything a
job does with a bucket, in one launch.

``python s3_worker.py BUCKET REF``: ``BUCKET/ddp`` holds a CheckpointManager folder the test saved in one process,
``REF`` (a local file) the state it saved there. Each rank then

1. resumes a DDP model and its optimizer from ``BUCKET/ddp`` through a manager (rank 0 chooses, every rank reads its
   own byte ranges), and saves the next step back (rank 0 uploads);
2. resumes the same object with ``broadcast_from_rank0`` (rank 0 alone reads the store, counted);
3. saves an FSDP2 model's sharded checkpoint folder into ``BUCKET/fsdp`` and resumes it into a fresh FSDP2 model;
4. prints one ``RESULT <json>`` line, then saves step 9 into ``BUCKET/ddp``, and rank 0 is SIGKILLed mid-upload.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import s3fs.core
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import dist_resume as dr
from dist_resume._store import upload
from dist_resume._store.ranges import _PIECES, READ_STATS


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def _optim_equal(live: torch.optim.Optimizer, saved: dict[str, Any]) -> list[str]:
    state = live.state_dict()["state"]
    return [
        f"{i}.{k}"
        for i, entries in saved["state"].items()
        for k, v in entries.items()
        if not torch.equal(state[i][k], v)
    ]


def _optim_equal_by_name(live: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    return [
        f"{name}.{k}"
        for name, entries in saved["state"].items()
        for k, v in entries.items()
        if not torch.equal(live["state"][name][k], v)
    ]


def main() -> None:
    bucket, ref_path = sys.argv[1], sys.argv[2]
    dr.init_distributed()
    rank = dist.get_rank()
    ref = torch.load(ref_path, weights_only=True)
    out: dict[str, Any] = {"rank": rank}

    model = DDP(net())
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    with dr.CheckpointManager(f"{bucket}/ddp", model=model, optimizer=opt, keep_last=3) as mgr:
        result = mgr.resume()
        assert result is not None and result.step is not None
        out["ddp_step"] = result.step
        out["ddp_path"] = str(result.path)
        out["ddp_model"] = _equal(model.module.state_dict(), ref["model"])
        out["ddp_optim"] = _optim_equal(opt, ref["optimizer"])
        mgr.save(result.step + 1)
        out["ddp_saved"] = [p.name for p in mgr.checkpoints()]

    plain = net()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    _PIECES.clear()  # the manager's resume read this small object whole into the cache: count from nothing
    READ_STATS.reset()
    options = dr.ResumeOptions(broadcast_from_rank0=True)
    dr.resume(out["ddp_path"], model=plain, optimizer=plain_opt, options=options)
    out["broadcast_requests"] = READ_STATS.requests
    out["broadcast_model"] = _equal(plain.state_dict(), ref["model"])
    out["broadcast_optim"] = _optim_equal(plain_opt, ref["optimizer"])

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = net()
    fully_shard(sharded, mesh=mesh)
    sharded_opt = torch.optim.AdamW(sharded.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    sharded(torch.randn(8, 16, generator=g)).sum().backward()
    sharded_opt.step()
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    before_model = get_model_state_dict(sharded, options=full)
    before_optim = get_optimizer_state_dict(sharded, sharded_opt, options=full)
    with dr.CheckpointManager(f"{bucket}/fsdp", model=sharded, optimizer=sharded_opt) as mgr:
        path = mgr.save(5)
        out["fsdp_saved"] = str(path)
    again = net()
    fully_shard(again, mesh=mesh)
    again_opt = torch.optim.AdamW(again.parameters(), lr=0.01)
    with dr.CheckpointManager(f"{bucket}/fsdp", model=again, optimizer=again_opt) as mgr:
        resumed = mgr.resume()
        assert resumed is not None
        out["fsdp_step"] = resumed.step
    after_model = get_model_state_dict(again, options=full)
    after_optim: dict[str, Any] = dict(get_optimizer_state_dict(again, again_opt, options=full))
    if rank == 0:
        out["fsdp_model"] = _equal(before_model, after_model)
        out["fsdp_optim"] = _optim_equal_by_name(after_optim, dict(before_optim))
    # one write: under PYTHONUNBUFFERED, print() writes the line and its newline apart, and two ranks' lines interleave
    sys.stdout.write(f"RESULT {json.dumps(out)}\n")
    sys.stdout.flush()
    _killed_mid_upload(f"{bucket}/ddp")


def _killed_mid_upload(folder: str) -> None:
    """Save the next step of a 6 MiB model; rank 0 dies by SIGKILL once the upload's first 5 MiB part is up, as a
    preempted node dies (the agent then stops rank 1). Never returns."""
    upload.PART_BYTES = 5 << 20  # type: ignore[misc]  # S3's smallest part: a 6 MiB model is mid-upload after one
    send = s3fs.core.S3File._upload_chunk

    def first_part_then_die(self: Any, final: bool = False) -> Any:
        done = send(self, final)
        if self.parts:  # a part is up: the object is half uploaded
            os.kill(os.getpid(), signal.SIGKILL)
        return done

    s3fs.core.S3File._upload_chunk = first_part_then_die
    mgr = dr.CheckpointManager(folder, keep_last=5)
    mgr.save(9, model=nn.Linear(1024, 1536))
    raise AssertionError("the save went through: rank 0 was not killed mid-upload")


if __name__ == "__main__":
    main()
