"""What ``dist-resume check``'s diagnosis reads (:class:`Evidence`): the compared pairs, which launch wrote each
checkpoint, and, at the first checkpoint that differs and was written after a resume, how far apart each rank's RNG
streams are (:mod:`._streams`) and how far apart the data positions are, in samples and in steps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Any

from ._compare import PairResult
from ._launch import Launch

if TYPE_CHECKING:
    from ._streams import RankStreams

__all__ = ["Evidence", "collect_evidence", "where", "recorded", "sample_index", "samples_per_step"]


@dataclass(frozen=True)
class Evidence:
    """The compared pairs (ascending, the newest last), the first that differs, the interrupted run's launches and
    which launch wrote each of its checkpoints (by name; 1 is the first launch). ``unseeded``: Python's and NumPy's
    streams differ at every pair (a command that does not seed them); ``first`` is then the first pair where something
    else differs too. ``streams``: each rank's RNG streams at :attr:`after`, compared (() when not measured).
    ``strict_extra``: ``extra`` counts as a difference (else ``first`` is the first pair where more than it differs)."""

    results: Sequence[PairResult]
    first: PairResult | None
    launches: Sequence[Launch]
    written_by: dict[str, int]
    unseeded: bool = False
    streams: tuple[RankStreams, ...] = ()
    strict_extra: bool = False

    @property
    def after(self) -> PairResult | None:
        """``first`` where a relaunch wrote it (after a resume; every checkpoint before it is equal), else None."""
        first = self.first
        return first if first is not None and self.written_by.get(first.pair.interrupted.name, 1) >= 2 else None

    def launch_of(self, result: PairResult) -> int | None:
        return self.written_by.get(result.pair.interrupted.name)


def collect_evidence(
    results: Sequence[PairResult],
    first: PairResult | None,
    launches: Sequence[Launch],
    written_by: dict[str, int],
    *,
    unseeded: bool = False,
    strict_extra: bool = False,
) -> Evidence:
    """The :class:`Evidence`, with the RNG streams measured at its first checkpoint written after a resume (Python's
    stream only when the command seeds it). Local."""
    ev = Evidence(results, first, launches, written_by, unseeded, strict_extra=strict_extra)
    after = ev.after
    if after is None or not any(p.part.startswith("rng") for p in after.parts):
        return ev
    from ._streams import rank_streams  # torch: only where streams differ

    measured = ("torch",) if unseeded else ("torch", "python")
    streams = rank_streams(*after.rng, shifts=measured)
    return Evidence(results, first, launches, written_by, unseeded, streams, strict_extra)


def where(ev: Evidence, result: PairResult) -> str:
    """``step 12 (ckpt_00000012.pt, written after a resume)``: a pair said with its checkpoint and its launch."""
    name = result.pair.interrupted.name
    launch = ev.launch_of(result)
    said = {None: "", 1: ", written before the first interruption"}.get(launch, ", written after a resume")
    at = f"step {result.pair.step}" if result.pair.step is not None else "the newest checkpoint"
    return f"{at} ({name}{said})"


def recorded(result: PairResult, key: str) -> tuple[Any, Any]:
    """What each checkpoint of ``result`` records under ``key`` in its ``meta`` (None where it has no such entry)."""
    a, b = (m.get(key) if isinstance(m, Mapping) else None for m in result.meta)
    return a, b


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def sample_index(position: Any) -> int | None:
    """The global index of the next sample a saved data position (a ``ResumableDistributedSampler``'s state: epoch,
    samples consumed globally, dataset length, world size, drop_last) points at, counted from the first epoch; None
    for another form."""
    if not isinstance(position, Mapping):
        return None
    epoch, consumed = _int(position.get("epoch")), _int(position.get("consumed"))
    if epoch is None or consumed is None:
        return None
    if epoch == 0:
        return consumed
    n, world = _int(position.get("num_samples")), _int(position.get("world_size"))
    if n is None or world is None or world < 1:
        return None
    per_epoch = n // world * world if position.get("drop_last") else -(-n // world) * world
    return epoch * per_epoch + consumed


def samples_per_step(results: Sequence[PairResult]) -> int | None:
    """How many samples the reference's data position moves per optimizer step, where all its compared checkpoints
    with steps agree on one positive number; else None."""
    points = [
        (r.pair.step, i) for r in results if r.pair.step is not None and (i := sample_index(r.position[0])) is not None
    ]
    spans = [(s2 - s1, i2 - i1) for (s1, i1), (s2, i2) in pairwise(points)]
    if not spans or spans[0][0] <= 0 or spans[0][1] % spans[0][0]:
        return None
    rate = spans[0][1] // spans[0][0]
    return rate if rate > 0 and all(steps > 0 and moved == rate * steps for steps, moved in spans) else None
