"""dist_resume: resume PyTorch training under DDP and torchrun without surprises.

What a training script uses is importable from here; the tools behind the ``dist-resume`` command live in
``dist_resume.tools``, the exceptions in ``dist_resume.errors`` (their base, ``DistResumeError``, here too),
and the multi-process test launcher in ``dist_resume.testing``. The modules behind them are private. Every
exported class and function reports its public module, so reprs, tracebacks and pickles name the public path.
"""

from __future__ import annotations

from typing import Any

from . import errors, tools
from ._checkpoint.async_save import AsyncSave, save_checkpoint_async
from ._checkpoint.objects import TrainingObjects
from ._checkpoint.options import OptimizerHparams, ResumeOptions
from ._checkpoint.restore import ResumeResult, resume
from ._checkpoint.save import save_checkpoint
from ._core.publish import publish
from ._core.version import __version__
from ._dist.env import RankInfo, destroy_distributed, init_distributed, rank_device, rank_info
from ._exact.rng import derive_seed, load_rng_state_dict, rng_state_dict, seed_rng
from ._exact.sampler import ResumableDistributedSampler
from ._format.load import rank_map_location
from ._layout.layout import Layout
from ._manager.manager import CheckpointManager
from ._source.open import load_checkpoint
from ._state.adapt import adapt_state_dict
from ._state.devices import check_devices
from ._state.optim import optimizer_to
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
    # errors (the rest in dist_resume.errors)
    "DistResumeError",
]

publish(globals(), __all__, __name__)
del publish

# names that moved in 0.3: they keep working for one release, with a DeprecationWarning naming the new home
_MOVED = {name: tools for name in tools.__all__} | {
    name: errors for name in errors.__all__ if name != "DistResumeError"
}


def __getattr__(name: str) -> Any:
    import warnings

    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"dist_resume.{name} moved to {home.__name__}.{name} in dist_resume 0.3; the old name goes in 0.4",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(home, name)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
