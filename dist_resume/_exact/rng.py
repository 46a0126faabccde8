"""Per-rank RNG streams: capture, restore, seed, and the policy when the world size changes."""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
from collections.abc import Mapping
from typing import Any

import torch

from .._core.errors import StateMismatchError
from .._core.log import log_rank0, logger
from .._core.rank import global_rank, rank_and_world
from .._core.text import article
from .._dist.accelerator import device_rng_state, seed_device, set_device_rng_state
from .._state.validate import rng_state_problem

__all__ = [
    "rng_state_dict",
    "load_rng_state_dict",
    "seed_rng",
    "derive_seed",
    "restore_rank_rng",
    "param_device",
]

_base_seed: int | None = None  # the seed last given to seed_rng(); stored so new ranks can derive from it


def param_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (``cpu`` for an empty model): the rank's device."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def derive_seed(seed: int, rank: int = 0, step: int = 0) -> int:
    """A 63-bit seed for ``rank`` at ``step``, a pure function of its arguments. Local.

    Example::

        >>> dist_resume.derive_seed(0, rank=1) == dist_resume.derive_seed(0, rank=1) != dist_resume.derive_seed(0)
        True
    """
    digest = hashlib.sha256(f"dist_resume:{int(seed)}:{int(rank)}:{int(step)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def seed_rng(seed: int, *, rank: int | None = None, step: int = 0, device: torch.device | str | None = None) -> int:
    """Seed python ``random``, torch's CPU generator, ``device``'s accelerator generator and numpy for this rank.

    Local. Each rank gets its own stream, ``derive_seed(seed, rank, step)`` (``rank`` defaults to
    this process's global rank); returns that derived seed. Build the model *before* calling it
    (after ``torch.manual_seed(seed)``) so every rank starts from the same weights.

    Example::

        >>> dist_resume.seed_rng(1234, rank=0) == dist_resume.derive_seed(1234, 0)
        True
    """
    global _base_seed
    if rank is None:
        rank = global_rank()
    derived = derive_seed(seed, rank, step)
    random.seed(derived)
    torch.default_generator.manual_seed(derived)
    if device is not None:
        seed_device(derived, torch.device(device))  # this rank's device only; nothing for cpu
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(derived % 2**32)
    _base_seed = int(seed)
    return derived


def rng_state_dict(device: torch.device | str | None = None) -> dict[str, Any]:
    """This process's RNG streams: python ``random``, torch CPU, ``device``'s accelerator stream, numpy.

    Local. Only the generator of ``device`` is read (never every visible device's: ``get_rng_state_all``
    initialises them all), through its device module (``torch.get_device_module``), and stored as
    ``{"type": device type, "state": uint8 tensor}`` under ``"device"`` (None on the CPU, or for a
    backend without RNG state). numpy's state is stored as a tensor and plain numbers, so the result
    loads under ``torch.load(weights_only=True)``. numpy is skipped when not installed.

    Example::

        >>> state = dist_resume.rng_state_dict("cpu")
        >>> a = torch.rand(1); dist_resume.load_rng_state_dict(state, "cpu"); torch.equal(a, torch.rand(1))
        True
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    device_state = device_rng_state(dev)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "device": None if device_state is None else {"type": dev.type, "state": device_state},
        "numpy": None,
        "seed": _base_seed if _base_seed is not None else torch.initial_seed(),
    }
    try:
        import numpy as np
    except ImportError:
        return state
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # type: ignore[misc]
    state["numpy"] = {
        "bit_generator": str(name),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def load_rng_state_dict(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Restore what :func:`rng_state_dict` captured. Local.

    The device stream is applied to ``device`` only. When it was saved on another device type (a
    checkpoint from CUDA resumed on an XPU or the CPU), the CPU, Python and numpy streams are restored
    and rank 0 says at WARNING which device stream was not; numpy's is skipped with a WARNING when numpy
    is not installed, never silently. Files of dist_resume 0.2 (a ``"cuda"`` entry) read the same way.
    The state is checked before any stream changes.

    Example::

        >>> dist_resume.load_rng_state_dict(dist_resume.rng_state_dict())
    """
    problem = rng_state_problem(state)  # every stream tried on a throwaway generator first
    saved = _device_entry(state) if isinstance(state, Mapping) else None
    if problem is not None:
        raise StateMismatchError(f"RNG state is not one rng_state_dict() writes: {problem}; no stream was changed")
    dev = torch.device(device) if device is not None else torch.device("cpu")
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(state["torch"].to("cpu", torch.uint8))
    if saved is not None:
        saved_type, saved_state = saved
        if saved_type != dev.type or not set_device_rng_state(saved_state, dev):
            log_rank0(
                logging.WARNING,
                "the saved %s RNG stream is not restored: this process runs on %s (the CPU, Python and numpy "
                "streams are restored)",
                saved_type,
                dev,
            )
    saved_np = state.get("numpy")
    if saved_np is not None:
        try:
            import numpy as np
        except ImportError:
            logger.warning("the saved numpy RNG state is not restored: numpy is not installed")
            return
        np.random.set_state(
            (
                saved_np["bit_generator"],
                saved_np["keys"].cpu().numpy().astype(np.uint32),  # map_location may have put it on a device
                saved_np["pos"],
                saved_np["has_gauss"],
                saved_np["cached_gaussian"],
            )
        )


def _device_entry(state: Mapping[str, Any]) -> tuple[str, torch.Tensor] | None:
    """(device type, state) of the saved device stream; None without one. Raises before anything changes."""
    entry = state.get("device")
    if entry is None:
        entry = state.get("cuda")  # dist_resume 0.2 kept the CUDA stream, a bare tensor, under "cuda"
        if entry is None or isinstance(entry, torch.Tensor):
            return None if entry is None else ("cuda", entry)
    if isinstance(entry, Mapping):
        kind, saved = entry.get("type"), entry.get("state")
        if isinstance(kind, str) and isinstance(saved, torch.Tensor):
            return kind, saved
    found = (
        f"a mapping with keys {sorted(map(str, entry))}"
        if isinstance(entry, Mapping)
        else article(type(entry).__name__)
    )
    raise StateMismatchError(
        f"the RNG state's device stream must be {{'type': str, 'state': tensor}} as rng_state_dict() writes it, "
        f"got {found}; resume with ResumeOptions(rng=False) to keep the current streams"
    )


def restore_rank_rng(states: Any, *, step: int | None, device: torch.device | None, source: str) -> bool:
    """Restore this rank's RNG streams from a checkpoint's per-rank list; return whether anything was restored.

    Local. Policy when the world size changed: ranks that exist in the checkpoint restore their own
    streams; new ranks seed theirs with ``derive_seed(saved seed, rank, step)``; rank 0 logs the
    change at WARNING, including saved streams that no rank restores.
    """
    if states is None:
        log_rank0(logging.INFO, "%s holds no RNG state; the RNG streams are left as they are", source)
        return False
    if not isinstance(states, (list, tuple)) or not states:
        raise StateMismatchError(
            f"{source}: the RNG entry is {article(type(states).__name__)}, not a list of per-rank states"
        )
    rank, world = rank_and_world()
    if rank < len(states):
        load_rng_state_dict(states[rank], device)
    else:
        derived = seed_rng(int(states[0]["seed"]), rank=rank, step=step or 0, device=device)
        logger.debug("rank %d: no saved RNG state; seeded with %d", rank, derived)
    if len(states) != world:
        kept = _ranks(0, min(world, len(states)) - 1)
        if world > len(states):
            change = (
                f"new streams on {_ranks(len(states), world - 1)}, derived from the saved seed "
                f"{states[0]['seed']}, the rank and step {step}"
            )
        else:
            change = f"the saved streams of {_ranks(world, len(states) - 1)} are not used"
        log_rank0(
            logging.WARNING,
            "%s holds RNG state for %d rank(s) but the job has %d: own streams restored "
            "on %s; %s; training continues, but not as a bitwise replay of the original run",
            source,
            len(states),
            world,
            kept,
            change,
        )
    return True


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
