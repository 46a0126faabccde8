"""Per-rank bodies for tests/dist/test_fsdp.py: anonymous memory while a full checkpoint loads into FSDP2 shards."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import dist_resume as dr
from dist_resume._core.shards import shard_spec
from dist_resume._dist.shard_comm import scatter_full_into
from dist_resume._state.optim.prepare import prepare_optimizer_state
from dist_resume._state.optim.sharded import load_full_optimizer_state, sharded_optimizer_state
from dist_resume._state.sharded import load_full_model_state, model_destinations
from tests.dist.fsdp_workers import meta_stand_ins
from tests.helpers import local_shard


class _AnonPeak:
    """Samples this process's RssAnon (KiB) every half millisecond from a thread; ``growth`` is peak minus start."""

    def __init__(self) -> None:
        _trim()  # freed heap goes back to the kernel: what the block allocates shows as new anonymous pages
        self.start = self.peak = _rss_anon()
        self.samples = 0
        self._stop = threading.Event()
        self._sampling = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss_anon())
            self.samples += 1
            self._sampling.set()
            time.sleep(0.0005)

    def __enter__(self) -> _AnonPeak:
        self._thread.start()
        # the block starts once the thread has sampled: under load a thread just started may not run before a short
        # block ends (one sample, the one taken at exit, seen in a full run)
        self._sampling.wait()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())

    @property
    def growth(self) -> int:
        return (self.peak - self.start) * 1024


def _sampled(block: Callable[[], None], tries: int = 5) -> _AnonPeak:
    """``block`` under a sampler, again (on every rank: the block may hold collectives) while a rank's sampler took no
    sample inside it: a loaded machine can leave the sampler's thread unscheduled for a whole short block (a CI-like
    session saw one sample in the block of copies). Loading the same state again allocates what it did the first time.
    """
    for _ in range(tries):
        dist.barrier()
        with _AnonPeak() as peak:
            block()
        short = torch.tensor([int(peak.samples < 2)])
        dist.all_reduce(short)
        if not short.item():
            break
    return peak


def _trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _unmap_large_frees() -> None:
    """Every allocation of 1 MiB or more is its own mapping, returned to the kernel when freed (glibc's threshold is
    fixed, not raised by the first large free): the sampler then sees what is alive, not what the heap kept. Without
    it the sharded folder's growth varied from 8.6 to 32.3 MiB between runs of the same code, with load on the
    machine."""
    m_mmap_threshold = -3  # glibc's mallopt parameter
    ctypes.CDLL("libc.so.6").mallopt(m_mmap_threshold, 1 << 20)


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    raise RuntimeError("no RssAnon in /proc/self/status")


def anon_growth(rank: int, world_size: int, folder: str, width: int) -> dict[str, Any]:
    """Anonymous-memory growth while a 4-layer checkpoint (width x width weights) loads into a stepped FSDP2 model."""
    _unmap_large_frees()
    mesh = init_device_mesh("cpu", (world_size,))
    ckpt = Path(folder) / "big.pt"

    def build(seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        return nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(4)))

    if rank == 0:
        plain = build(0)
        plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
        plain(torch.ones(1, width)).sum().backward()
        plain_opt.step()
        torch.save({"model": plain.state_dict(), "optimizer": plain_opt.state_dict()}, ckpt)
        del plain, plain_opt
    dist.barrier()
    model = build(1)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # after fully_shard: over the DTensor parameters
    model(torch.ones(1, width)).sum().backward()
    opt.step()  # the state exists: a resume after a rollback, or state built eagerly
    opt.zero_grad(set_to_none=True)
    shard = sum(local_shard(p).nbytes for p in model.parameters()) * 3
    saved = torch.load(ckpt, map_location="cpu", mmap=True, weights_only=True)

    def copy() -> None:
        load_full_model_state(model, saved["model"])
        load_full_optimizer_state(opt, prepare_optimizer_state(saved["optimizer"], opt, model))

    copied = _sampled(copy)
    source = saved if rank == 0 else meta_stand_ins(saved)

    def scatter() -> None:
        pairs = [(full, dst) for _, full, dst in model_destinations(model, source["model"])]
        opt_sd, opt_pairs = sharded_optimizer_state(opt, prepare_optimizer_state(source["optimizer"], opt, model))
        scatter_full_into(pairs + opt_pairs)
        opt.load_state_dict(opt_sd)

    scattered = _sampled(scatter)
    # the same through resume: every rank's mapping (a file), rank 0's scatter, dcp.load of a sharded folder
    folder_ckpt = dr.save_checkpoint(Path(folder) / "big.dcp", model=model, optimizer=opt, step=1)
    growth = {}
    for name, path, options in (
        ("resume_copy_growth", ckpt, dr.ResumeOptions(rng=False)),
        ("resume_scatter_growth", ckpt, dr.ResumeOptions(rng=False, broadcast_from_rank0=True)),
        ("resume_folder_growth", folder_ckpt, dr.ResumeOptions(rng=False)),
    ):
        dist.barrier()
        with _AnonPeak() as resumed:
            dr.resume(path, model=model, optimizer=opt, options=options)
        growth[name] = resumed.growth
    dist.barrier()
    with _AnonPeak() as control:  # what materialising one full tensor looks like to the same sampler
        held = saved["model"]["0.weight"].clone()
    del held
    loaded_ok = all(
        torch.equal(local_shard(p), saved["model"][n][shard_spec(p).slices()]) for n, p in model.named_parameters()
    )
    return {
        "copy_growth": copied.growth,
        "scatter_growth": scattered.growth,
        "control_growth": control.growth,
        "samples": min(copied.samples, scattered.samples),
        "shard_bytes": shard,
        "tensor_bytes": width * width * 4,
        "loaded_ok": loaded_ok,
        **growth,
    }
