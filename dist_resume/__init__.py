"""dist_resume: resume PyTorch training under DDP and torchrun without surprises.

What a training script uses is importable from here; the tools behind the ``dist-resume`` command live in
``dist_resume.tools``, the exceptions in ``dist_resume.errors`` (their base, ``DistResumeError``, here too),
and the multi-process test launcher in ``dist_resume.testing``. The modules behind them are private. Every
exported class and function reports its public module, so reprs, tracebacks and pickles name the public path.

The names are loaded on first use (PEP 562): ``import dist_resume`` imports neither torch nor the modules
behind the names, so ``dist-resume list`` and ``verify`` can answer without torch; ``dist_resume.resume``
(or ``from dist_resume import resume``) imports what it needs then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Final

from ._core.version import __version__

# every fork of the process waits until no thread holds the interpreter's thread-list lock (CPython < 3.12)
importlib.import_module("._core.fork", __name__)

if TYPE_CHECKING:  # what the names below are, for type checkers and IDEs (the same imports, made eagerly)
    from . import errors as errors
    from . import tools as tools
    from ._checkpoint.objects import TrainingObjects
    from ._checkpoint.options import OptimizerHparams, ResumeOptions
    from ._checkpoint.restore import ResumeResult
    from ._checkpoint.resume import resume
    from ._core.log import set_verbosity
    from ._dist.env import RankInfo, destroy_distributed, init_distributed, rank_device, rank_info
    from ._exact.rng import derive_seed, load_rng_state_dict, rng_state_dict, seed_rng
    from ._exact.sampler import ResumableDistributedSampler
    from ._exact.samples import sample_seed
    from ._format.load import rank_map_location
    from ._layout.layout import Layout
    from ._manager.manager import CheckpointManager
    from ._save.async_save import AsyncSave
    from ._save.entry import save_checkpoint, save_checkpoint_async
    from ._source.open import load_checkpoint
    from ._state.adapt import adapt_state_dict
    from ._state.devices import check_devices
    from ._state.optim.placement import optimizer_to
    from ._state.prefix import add_prefix, canonical_key, strip_prefix, unwrap_model
    from .errors import DistResumeError

__all__ = [
    "__version__",
    # environment
    "RankInfo",
    "rank_info",
    "rank_device",
    "init_distributed",
    "destroy_distributed",
    # loading
    "rank_map_location",
    "load_checkpoint",
    # prefixes
    "strip_prefix",
    "add_prefix",
    "unwrap_model",
    "canonical_key",
    "adapt_state_dict",
    # optimizer and devices
    "optimizer_to",
    "check_devices",
    # checkpoints
    "save_checkpoint",
    "save_checkpoint_async",
    "AsyncSave",
    "resume",
    "ResumeOptions",
    "ResumeResult",
    "OptimizerHparams",
    "Layout",
    "CheckpointManager",
    "TrainingObjects",
    # exact resume
    "ResumableDistributedSampler",
    "rng_state_dict",
    "load_rng_state_dict",
    "seed_rng",
    "derive_seed",
    "sample_seed",
    # logging
    "set_verbosity",
    # errors (the rest in dist_resume.errors)
    "DistResumeError",
]

# where each exported name lives (the TYPE_CHECKING block above says the same to type checkers)
_HOMES: Final = {
    "AsyncSave": "._save.async_save",
    "TrainingObjects": "._checkpoint.objects",
    **dict.fromkeys(("OptimizerHparams", "ResumeOptions"), "._checkpoint.options"),
    "ResumeResult": "._checkpoint.restore",
    "resume": "._checkpoint.resume",
    **dict.fromkeys(("save_checkpoint", "save_checkpoint_async"), "._save.entry"),
    **dict.fromkeys(("RankInfo", "destroy_distributed", "init_distributed", "rank_device", "rank_info"), "._dist.env"),
    **dict.fromkeys(("derive_seed", "load_rng_state_dict", "rng_state_dict", "seed_rng"), "._exact.rng"),
    "ResumableDistributedSampler": "._exact.sampler",
    "sample_seed": "._exact.samples",
    "rank_map_location": "._format.load",
    "Layout": "._layout.layout",
    "CheckpointManager": "._manager.manager",
    "load_checkpoint": "._source.open",
    "adapt_state_dict": "._state.adapt",
    "check_devices": "._state.devices",
    "optimizer_to": "._state.optim.placement",
    **dict.fromkeys(("add_prefix", "canonical_key", "strip_prefix", "unwrap_model"), "._state.prefix"),
    "DistResumeError": ".errors",
    "set_verbosity": "._core.log",
}
_SUBMODULES: Final = ("errors", "tools", "testing")


def _moved_home(name: str) -> str | None:
    """The module a name of 0.2 moved to in 0.3 (``dist_resume.tools`` or ``dist_resume.errors``), else None."""
    for module in ("tools", "errors"):
        names: list[str] = importlib.import_module(f".{module}", __name__).__all__
        if name in names and name != "DistResumeError":
            return module
    return None


def _load_names() -> None:
    """Import every exported name at once and publish it (``__module__ = "dist_resume"``), as an eager import did:
    the first script to touch one name uses torch anyway, and every repr and pickle names the public path."""
    from ._core.publish import publish

    loaded = {name: getattr(importlib.import_module(home, __name__), name) for name, home in _HOMES.items()}
    publish(loaded, loaded, __name__)
    globals().update(loaded)  # from now on plain attributes


def __getattr__(name: str) -> Any:
    if name in _HOMES:
        _load_names()
        return globals()[name]
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    moved = _moved_home(name) if not name.startswith("__") else None
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    # names that moved in 0.3: they keep working until 0.5 (one release more than 0.3 said), with a DeprecationWarning naming the new home
    warnings.warn(
        f"dist_resume.{name} moved to dist_resume.{moved}.{name} in dist_resume 0.3; the old name goes in 0.5",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module(f".{moved}", __name__), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__, "errors", "tools"})
