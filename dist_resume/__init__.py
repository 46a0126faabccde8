"""dist_resume: resume PyTorch training under DDP and torchrun without surprises.

Everything public is importable from here (and ``dist_resume.testing``, the multi-process test
launcher); the modules behind it are private. Every exported class and function reports
``dist_resume`` as its module, so reprs, tracebacks and pickles name the public path.
"""

from __future__ import annotations

from ._checkpoint.async_save import AsyncSave, save_checkpoint_async
from ._checkpoint.options import OptimizerHparams
from ._checkpoint.restore import ResumeResult, resume
from ._checkpoint.save import save_checkpoint
from ._convert.convert import ConvertResult, KeyForm, convert_checkpoint
from ._convert.formats import ConvertFormat
from ._core.errors import (
    CheckpointConsensusError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    DeviceMismatchError,
    DistResumeError,
    EnvironmentMismatchError,
    KeyMismatchError,
    NotACheckpointError,
    OptimizerStateMismatchError,
    StateMismatchError,
    UnsafeCheckpointError,
    UsageError,
)
from ._core.security import TorchSecurityWarning
from ._core.version import __version__
from ._dist.env import RankInfo, destroy_distributed, init_distributed, rank_device, rank_info
from ._exact.rng import derive_seed, load_rng_state_dict, rng_state_dict, seed_rng
from ._exact.sampler import ResumableDistributedSampler
from ._format.load import rank_map_location
from ._format.records import ArchiveFinding, FindingKind
from ._layout.layout import Layout
from ._manager.manager import CheckpointManager
from ._source.consensus import resolve_checkpoint
from ._source.integrity import CheckpointInfo, inspect_checkpoint, verify_archive
from ._source.listing import latest_checkpoint
from ._source.open import load_checkpoint
from ._state.adapt import adapt_state_dict
from ._state.devices import check_devices, device_report
from ._state.optim import optimizer_to
from ._state.prefix import add_prefix, canonical_key, strip_prefix, unwrap_model

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
    "device_report",
    "check_devices",
    # checkpoints
    "save_checkpoint",
    "save_checkpoint_async",
    "AsyncSave",
    "resume",
    "ResumeResult",
    "OptimizerHparams",
    "Layout",
    # checkpoint folders, integrity, conversion
    "CheckpointManager",
    "latest_checkpoint",
    "resolve_checkpoint",
    "CheckpointInfo",
    "inspect_checkpoint",
    "verify_archive",
    "ArchiveFinding",
    "FindingKind",
    "convert_checkpoint",
    "ConvertResult",
    "KeyForm",
    "ConvertFormat",
    # exact resume
    "ResumableDistributedSampler",
    "rng_state_dict",
    "load_rng_state_dict",
    "seed_rng",
    "derive_seed",
    # errors
    "DistResumeError",
    "EnvironmentMismatchError",
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointCorruptError",
    "NotACheckpointError",
    "UnsafeCheckpointError",
    "CheckpointWriteError",
    "CheckpointConsensusError",
    "StateMismatchError",
    "KeyMismatchError",
    "OptimizerStateMismatchError",
    "DeviceMismatchError",
    "UsageError",
    "TorchSecurityWarning",
]


def _publish() -> None:
    """Set ``__module__ = "dist_resume"`` on every exported class and function (not on modules or values).

    A class's string annotations (``from __future__ import annotations``) resolve in its module's
    namespace, which the rename would hide from ``typing.get_type_hints``: they are resolved first.
    Functions resolve theirs in ``__globals__`` and need nothing.
    """
    import inspect
    import typing

    for name in __all__:
        obj = globals()[name]
        if inspect.isclass(obj):
            own = inspect.get_annotations(obj)
            if own:
                hints = typing.get_type_hints(obj)
                obj.__annotations__ = {key: hints[key] for key in own}
        if inspect.isclass(obj) or inspect.isfunction(obj):
            obj.__module__ = __name__


_publish()
del _publish
