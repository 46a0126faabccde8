"""The causes ``dist-resume check`` reads from what the checkpoints record about how the run was set up (the ``meta``
entries :mod:`dist_resume._save.evidence` writes), at the first checkpoint that differs and was written after a resume.

- A data position that counts prefetched batches (``data_position_prefetched``): the resumed run skipped them. When
  that data position differs, it explains what follows from it too (the RNG streams a shorter epoch moves on earlier,
  a model trained on other batches), so the diagnosis names it alone (:func:`prefetched_position`).
- A DDP model at more than 2 ranks whose checkpoints record no bucket layout (``ddp`` without ``ddp_buckets``), the
  training state alone differing from the first checkpoint after the resume on: DDP reduced the resumed run's first
  step in the one bucket it builds at construction, the uninterrupted run's in its rebuilt buckets, and past 2 ranks
  each sum then adds in another order (FACTS 42) (:func:`ddp_first_step`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from ..._core.text import preview
from ..._save.evidence import BUCKETS_KEY, DDP_KEY, NOT_REPLAYED_KEY, PREFETCHED_KEY
from ._evidence import Evidence, recorded, sample_index, where
from ._result import Cause

__all__ = ["prefetched_position", "ddp_first_step"]

Found = tuple[Cause, str]
_TRAINED: Final = frozenset({"model", "optimizer", "ema", "extra"})  # what the bucket order moves (and a loss log)
_QUOTED: Final = 1000  # characters of the recorded WARNING quoted (a file may hold any string there)


def _count(value: Any) -> int | None:
    return value if type(value) is int and value > 0 else None


def _prefetched(entry: Any) -> tuple[int, int, str] | None:
    """``(workers, prefetch_factor, warning)`` of a ``data_position_prefetched`` entry; None for any other value."""
    if not isinstance(entry, Mapping):
        return None
    workers, factor, text = _count(entry.get("workers")), _count(entry.get("prefetch_factor")), entry.get("warning")
    if workers is None or factor is None:
        return None
    if not isinstance(text, str):
        text = ""
    return workers, factor, text if len(text) <= _QUOTED else text[: _QUOTED - 3] + "..."


def prefetched_position(ev: Evidence) -> Found | None:
    """The data position differs at the first checkpoint written after a resume, and the checkpoints record that it
    counts prefetched batches."""
    after = ev.after
    if after is None or not after.differs("data position"):
        return None
    found = next((p for r in ev.results for entry in recorded(r, PREFETCHED_KEY) if (p := _prefetched(entry))), None)
    if found is None:
        return None
    workers, factor, warning = found
    ref, got = (sample_index(p) for p in after.position)
    ahead = got - ref if ref is not None and got is not None else None
    how_far = f", {ahead} samples ahead of the reference's (sample {got} of the run vs {ref})" if ahead else ""
    said = f" (the WARNING its first save logged: {warning})" if warning else ""
    return Cause.DATA_POSITION, (
        f"the data position differs at {where(ev, after)}{how_far}, and the checkpoints record that it counts the "
        f"batches a DataLoader's {workers} worker(s) prefetched ({factor} each), not only those trained on: the "
        f"resumed run skipped them{said}. What follows from it is not a cause of its own: the batches trained on "
        "differ, and a shorter epoch moves the RNG streams on earlier"
    )


def ddp_first_step(ev: Evidence) -> Found | None:
    """The training state differs from the first checkpoint written after a resume on, in a DDP run at more than 2
    ranks whose checkpoints record no bucket layout; the RNG streams and the data position are equal there."""
    after = ev.after
    if after is None or after.held["rng"] != (True, True) or not any(after.differs(p) for p in ("model", "optimizer")):
        return None
    if not {p.part for p in after.parts} <= _TRAINED:
        return None
    index = next(i for i, r in enumerate(ev.results) if r is after)
    before = ev.results[index - 1] if index else None
    if before is not None and ev.launch_of(before) == ev.launch_of(after):
        return None  # the relaunch's first checkpoint was equal: its first step after the resume was not the cause
    world = after.world_size[1]
    if recorded(after, DDP_KEY)[1] is not True or type(world) is not int or world <= 2:
        return None
    refused = next((why for why in recorded(after, NOT_REPLAYED_KEY) if isinstance(why, str)), None)
    if refused is None and any(
        layout is not None for r in ev.results[: index + 1] for layout in recorded(r, BUCKETS_KEY)
    ):
        return None
    parts = preview((str(p) for p in after.parts if p.part in ("model", "optimizer")), 2, quote=False)
    if refused is not None:
        return Cause.DDP_FIRST_STEP_BUCKETS, (
            f"the training state differs at {where(ev, after)} ({parts}), the first checkpoint after the resume, while "
            f"the RNG streams and the data position are equal: the run is DDP at {world} ranks, and its resume could "
            f"not give DDP the saved bucket layout ({refused[:300]}), so its first step summed each gradient element "
            "in another order than the uninterrupted run's same step; past 2 ranks the sums differ in their last bits "
            "(docs/exact-resume.md#ddp-buckets)"
        )
    return Cause.DDP_FIRST_STEP_BUCKETS, (
        f"the training state differs at {where(ev, after)} ({parts}), the first checkpoint after the resume, while "
        f"the RNG streams and the data position are equal: the run is DDP at {world} ranks, and its checkpoints "
        f"record no bucket layout (meta {BUCKETS_KEY!r}) for the resume to replay. DDP reduces its first step after "
        "construction in one bucket and then rebuilds its buckets in the order the gradients became ready, so the "
        "resumed run's first step summed each gradient element in another order than the uninterrupted run's same "
        "step; past 2 ranks the sums differ in their last bits, and momentum and BatchNorm amplify it. Nothing in "
        "the script causes it (a 2-rank run is bitwise): dist_resume records the layout where it can replay it "
        "(docs/exact-resume.md says for which DDP variants)"
    )
