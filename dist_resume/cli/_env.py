"""``dist-resume env``: what torchrun told this process, and what dist_resume makes of it."""

from __future__ import annotations

import os
import socket
from dataclasses import asdict
from typing import Any, Final

import torch

from .._core.errors import EnvironmentMismatchError
from .._core.version import __version__
from .._dist.accelerator import backend_for, current_accelerator, visible_devices
from .._dist.env import rank_device, rank_info
from ._common import SCHEMA_PREFIX

__all__ = ["TORCHRUN_VARIABLES", "environment_report", "render_env"]

SCHEMA = f"{SCHEMA_PREFIX}/env/2"
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
    """The ``env --json`` report. Local; reads the environment and asks torch about the accelerator, starts nothing."""
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
    acc = current_accelerator()
    name, value = visible_devices(acc.type) if acc else (None, None)
    # the same rule as dist_resume.init_distributed: the device type's backend, gloo on the CPU
    backend = None if device is None else backend_for(torch.device(device).type)
    torchrun = {var: os.environ.get(var) for var in TORCHRUN_VARIABLES}
    return {
        "schema": SCHEMA,
        "torchrun": torchrun,
        "launched_by_torchrun": torchrun["TORCHELASTIC_RUN_ID"] is not None,
        "rank_info": info,
        "device": device,
        "accelerator": {
            "type": acc.type if acc else None,
            "device_count": acc.count if acc else 0,
            "visible_devices_variable": name,
            "visible_devices": value,
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
    acc = report["accelerator"]
    if acc["type"] is None:
        found = "no accelerator"
    else:
        found = f"{acc['device_count']} {acc['type']} device(s)"
        if acc["visible_devices_variable"] is not None:
            found += f", {acc['visible_devices_variable']}={acc['visible_devices'] or '<unset>'}"
    lines.append(f"device       {report['device'] or '-'} ({found})")
    lines.append(f"backend      {report['backend'] or '-'}")
    lines.append(
        f"torch        {report['torch_version']}  dist_resume {report['dist_resume_version']}  "
        f"host {report['host']}  pid {report['pid']}"
    )
    lines += [f"problem: {p}" for p in report["problems"]]
    return "\n".join(tag + line for line in lines)
