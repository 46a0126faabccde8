"""A process group that a ``torchrun --max-restarts`` restart may fail to create again (FACTS 45).

torchrun's agent shares its rendezvous TCPStore with the workers (``TORCHELASTIC_USE_AGENT_STORE=True``, the same
``MASTER_PORT`` in every attempt), and torch's ``env://`` rendezvous adds no per-attempt prefix ("we create a new
TCPStore for every retry", but the agent's store lives on): a restarted rank can read the dead attempt's gloo (or NCCL)
address of its peer before the peer overwrites it, and a restart can fail in ``init_process_group`` (FACTS 45: about
half of them; "Gloo connectFullMesh ... Connection refused"; pytorch issues 135712, 167288). :func:`dist_resume.init_distributed`
rendezvouses under a ``PrefixStore`` keyed by ``TORCHELASTIC_RESTART_COUNT`` and is not affected.

dist_resume cannot make a script's own ``init_process_group()`` safe: in the restarted attempt it runs before any
dist_resume call, and the only handles on it are torch's ``env://`` rendezvous handler (process-wide: replacing it is
a monkeypatch) and the agent's environment (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, which only the launch can set).
So the first collective dist_resume call warns, once, on rank 0, where the evidence shows the risk
(:func:`restart_risk`): restarts allowed, the agent's store shared, and a default group whose store is the
rendezvous store itself, with no prefix of the script's own between (``init_distributed``'s group, or a script's that
wraps the store in a ``PrefixStore`` keyed by the restart count, as FACTS 15 does, has one).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any, Final

import torch.distributed as dist

from .._core.log import log_rank0
from .._core.torch_compat.private import default_store

__all__ = ["RESTART_RISK", "restart_risk", "warn_restart_risk_once"]

RESTART_RISK: Final = (
    "this job runs under torchrun --max-restarts %d (TORCHELASTIC_MAX_RESTARTS) with the agent's rendezvous store "
    "shared with the workers (TORCHELASTIC_USE_AGENT_STORE=True), and its process group was made by the script's own "
    "init_process_group() on that store: after a restart, torch's env:// rendezvous can read the dead attempt's "
    "addresses from it, and a restart can then fail in init_process_group (Gloo connectFullMesh ... Connection "
    "refused; NCCL alike). Create the group with dist_resume.init_distributed() (it namespaces the "
    "rendezvous by TORCHELASTIC_RESTART_COUNT), or launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's "
    "environment (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --max-restarts ... train.py)"
)
_looked = False


def _max_restarts(env: Mapping[str, str]) -> int:
    text = env.get("TORCHELASTIC_MAX_RESTARTS", "").strip()
    return int(text) if text.isdigit() else 0


def _unprefixed(store: Any) -> bool:
    """Whether the default group's store (``PrefixStore("default_pg", ...)``, as ``init_process_group`` wraps every
    store) sits directly on the rendezvous store, with no ``PrefixStore`` of the script's own below it."""
    inner = getattr(store, "underlying_store", None)  # torch's PrefixStore (public since torch 2.1)
    return inner is not None and not isinstance(inner, dist.PrefixStore)


def restart_risk(env: Mapping[str, str] | None = None) -> str | None:
    """The warning for a process group a restart may fail to create again (see the module docstring), or None. Local.
    ``env``: the environment to read (``os.environ`` by default)."""
    env = os.environ if env is None else env
    restarts = _max_restarts(env)
    if restarts < 1 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # torch's own test: == str(True)
        return None
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        store = default_store()
    except (RuntimeError, ValueError, KeyError):  # no default store to look at: nothing shows the risk
        return None
    return RESTART_RISK % restarts if _unprefixed(store) else None


def warn_restart_risk_once() -> None:
    """Log :func:`restart_risk` (WARNING, rank 0) if it holds at the first call in this process; look no more after
    it (the environment and the default group do not change in between). Local."""
    global _looked
    if _looked:
        return
    _looked = True
    text = restart_risk()
    if text is not None:
        log_rank0(logging.WARNING, "%s", text)
