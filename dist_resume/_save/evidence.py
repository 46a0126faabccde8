"""What a checkpoint records, in its ``meta``, about how the run was set up, where no other part shows it: the evidence
``dist-resume check`` names a cause with. Each entry is written only where it holds (a reader takes only these exact
forms as evidence, never their absence alone):

- ``"ddp": True``: the model was saved from a ``DistributedDataParallel`` (perhaps inside ``torch.compile``). With
  the world size it tells that a resumed run's first step reduced its gradients in the buckets DDP builds at
  construction (FACTS 42).
- ``"data_position_prefetched": {"workers": n, "prefetch_factor": p, "warning": text}``: the saved data position
  counts the batches ``n`` DataLoader workers prefetched, not only those the loop trained on, so a resume skips them;
  ``text`` is the WARNING the first save logged for it (its ways to an exact position). A position that counts only
  what the loop took (``num_workers=0``, a loader whose iterator the save counts, torchdata's ``StatefulDataLoader``,
  ``sampler.state_dict(consumed=...)``) records nothing.

- ``"ddp_buckets_not_replayed": reason``: the resume of this run's DDP could not give it the saved bucket layout
  (:func:`~dist_resume._dist.ddp_buckets.replay_layout`: a forward pass before the resume, a built-in comm hook, ...),
  so its first step after that resume reduced in one bucket.

``"ddp_buckets"`` (:data:`BUCKETS_KEY`) is not written here: the DDP bucket layout a resume replays for its first step
is stored under it by the save of a DDP model whose layout can be replayed; a DDP checkpoint without it is the
check's evidence that a resumed run's first step reduced in other buckets than the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from torch import nn

from .._dist.ddp_buckets import not_replayed
from .._exact.loaders import LoaderPosition
from .._exact.sampler import PREFETCH_WARNING, ResumableDistributedSampler
from .._layout.meta import DDP_BUCKETS
from .striped_plan import is_ddp

__all__ = ["DDP_KEY", "PREFETCHED_KEY", "BUCKETS_KEY", "NOT_REPLAYED_KEY", "run_evidence"]

DDP_KEY: Final = "ddp"
PREFETCHED_KEY: Final = "data_position_prefetched"
BUCKETS_KEY: Final = DDP_BUCKETS
NOT_REPLAYED_KEY: Final = "ddp_buckets_not_replayed"


def _prefetched(data: Any) -> dict[str, Any] | None:
    """The ``data_position_prefetched`` entry for the data position ``data`` (what ``dataloader=`` became), or None
    where the position counts only the batches the loop took. The condition is the first save's WARNING's own."""
    if isinstance(data, LoaderPosition):
        text = data.ahead  # set by the state_dict() this save took
        if text is None:
            return None
        return {
            "workers": int(data.loader.num_workers),
            "prefetch_factor": int(data.loader.prefetch_factor or 2),
            "warning": text,
        }
    if isinstance(data, ResumableDistributedSampler):  # the sampler registered alone: it saw the workers draw
        drawing = data._prefetching
        if drawing is None:
            return None
        return {"workers": drawing[0], "prefetch_factor": drawing[1], "warning": PREFETCH_WARNING % drawing}
    return None  # a state dict given to save (sampler.state_dict(consumed=n)), a StatefulDataLoader, another sampler


def run_evidence(model: nn.Module, data: Any) -> dict[str, Any]:
    """The ``meta`` entries above for a save of ``model`` with the data position ``data`` ({} when none holds).
    Local."""
    found: dict[str, Any] = {}
    if is_ddp(model):
        found[DDP_KEY] = True
        reason = not_replayed(model)
        if reason is not None:
            found[NOT_REPLAYED_KEY] = reason[:1000]
    prefetched = None if data is None or isinstance(data, Mapping) else _prefetched(data)
    if prefetched is not None:
        found[PREFETCHED_KEY] = prefetched
    return found
