"""``dist-resume env``: what torchrun told this process, and what dist_resume makes of it."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from typing import Any, Final

import torch

from .._core.errors import EnvironmentMismatchError
from .._core.version import __version__
from .._dist.env import rank_device, rank_info
from ._common import SCHEMA_PREFIX

__all__ = ["TORCHRUN_VARIABLES", "environment_report", "render_env"]

SCHEMA = f"{SCHEMA_PREFIX}/env/1"
TORCHRUN_VARIABLES: Final = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
)


def environment_report() -> dict[str, Any]:
    """The ``env --json`` report. Local; reads the environment and asks torch about CUDA, starts nothing."""
    problems: list[str] = []
    info: dict[str, Any] | None = None
    device: str | None = None
    local_rank = None
    try:
        rinfo = rank_info()
        info = {**asdict(rinfo), "is_distributed": rinfo.is_distributed}
        local_rank = rinfo.local_rank
    except EnvironmentMismatchError as err:
        problems.append(str(err))
    if local_rank is not None:
        try:
            device = str(rank_device(local_rank))
        except EnvironmentMismatchError as err:
            problems.append(str(err))
    cuda = torch.cuda.is_available()
    # the same rule as dist_resume.init_distributed: nccl with CUDA, gloo otherwise
    backend = None if device is None else ("nccl" if device.startswith("cuda") else "gloo")
    torchrun = {name: os.environ.get(name) for name in TORCHRUN_VARIABLES}
    return {
        "schema": SCHEMA,
        "torchrun": torchrun,
        "launched_by_torchrun": torchrun["TORCHELASTIC_RUN_ID"] is not None,
        "rank_info": info,
        "device": device,
        "cuda": {
            "available": cuda,
            "device_count": torch.cuda.device_count() if cuda else 0,
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        },
        "backend": backend,
        "torch_version": str(torch.__version__),
        "dist_resume_version": __version__,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "problems": problems,
    }


def render_env(report: dict[str, Any]) -> str:
    """The human-readable form of :func:`environment_report`; every line names the rank under torchrun."""
    info = report["rank_info"]
    tag = f"[rank {info['rank']}] " if info and info["is_distributed"] else ""
    set_vars = " ".join(f"{k}={v}" for k, v in report["torchrun"].items() if v is not None)
    lines = [f"torchrun     {set_vars or 'no torchrun variables set (single process)'}"]
    if info:
        lines.append(
            f"rank info    rank {info['rank']} of {info['world_size']}, local rank {info['local_rank']} of "
            f"{info['local_world_size']}, node {info['node_rank']}"
            f"{' (distributed)' if info['is_distributed'] else ' (single process)'}"
        )
    cuda = report["cuda"]
    gpus = f"{cuda['device_count']} CUDA device(s)" if cuda["available"] else "CUDA not available"
    if cuda["visible_devices"] is not None:
        gpus += f", CUDA_VISIBLE_DEVICES={cuda['visible_devices']}"
    lines.append(f"device       {report['device'] or '-'} ({gpus})")
    lines.append(f"backend      {report['backend'] or '-'}")
    lines.append(
        f"torch        {report['torch_version']}  dist_resume {report['dist_resume_version']}  "
        f"host {report['host']}  pid {report['pid']}"
    )
    lines += [f"problem: {p}" for p in report["problems"]]
    return "\n".join(tag + line for line in lines)
