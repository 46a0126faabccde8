"""A resume under ``broadcast_from_rank0``: validate on stand-ins, receive what the steps need, apply, and receive the
rest straight into the live tensors at the commit.

Rank 0 reads the checkpoint and sends its structure (:func:`~dist_resume._source.read.read_broadcast`); every rank
plans on it (rank 0 on its data, the others on meta stand-ins) and the ranks agree. The tensors apply's steps read
(small states, optimizer hyperparameters, state a module with its own load hooks loads) arrive first, into fresh
memory; the model's, EMA's and the optimizer state's data arrive only at the commit, after the ranks agreed that every
step succeeded everywhere, into the live tensors themselves: no rank holds a copy of the model, only one bucket.
Collective: call on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._core.errors import CheckpointError
from .._core.rank import global_rank
from .._dist.agree import agree_across_ranks, gather_agreed
from .._dist.broadcast import Incoming
from .._source.read import SourceContents, read_broadcast
from .._source.source import Source
from .apply.transaction import Agree, Transfer
from .options import ResumeOptions
from .plan.restore_plan import RestorePlan, check_has_data

__all__ = ["restore_broadcast", "transfer_late"]

NOTHING = "could not restore the checkpoint, so nothing was restored on any rank"


def transfer_late(incoming: Incoming, slots: Sequence[int]) -> Transfer:
    """The commit's :data:`~dist_resume._checkpoint.apply.transaction.Transfer` of a broadcast resume: the data of ``slots`` (the
    same on every rank) received straight into the live tensors paired with them; pairs whose data is here already
    (rank 0's own, or data sent earlier) are copied locally. Collective; returns the first failure on this rank."""
    wanted = set(slots)

    def transfer(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Exception | None:
        dests: dict[int, torch.Tensor] = {}
        local: list[tuple[torch.Tensor, torch.Tensor]] = []
        for saved, dst in pairs:
            slot = incoming.slot(saved)
            if slot is not None and slot in wanted:
                dests[slot] = dst
            else:
                local.append((saved, dst))
        _, failure = incoming.send(slots, dests, what="the broadcast checkpoint's tensors", into_live=True)
        if failure is not None:
            return failure
        try:
            with torch.no_grad():
                for saved, dst in local:
                    dst.copy_(saved)
        except Exception as err:  # the caller's agreement tells every rank
            return err
        return None

    return transfer


def restore_broadcast(
    source: Source,
    options: ResumeOptions,
    plan_local: Callable[[SourceContents], RestorePlan],
    agree: Agree,
) -> tuple[SourceContents, RestorePlan, tuple[str, ...]]:
    """Rank 0 reads ``source``; every rank plans (``plan_local``), receives what the steps need, applies, and receives
    the rest at the commit. Returns what was read, the plan and the names of the parts restored. Collective."""
    contents, incoming = read_broadcast(
        source, mmap=options.mmap, weights_only=options.weights_only, verify=options.verify
    )
    try:
        return contents, *_restore(contents, incoming, plan_local, agree)
    finally:
        if contents.ranged is not None:  # rank 0 read a store's object by ranges: its window goes
            contents.ranged.close()


def _restore(
    contents: SourceContents, incoming: Incoming, plan_local: Callable[[SourceContents], RestorePlan], agree: Agree
) -> tuple[RestorePlan, tuple[str, ...]]:
    source = contents.source
    everything = set(range(incoming.slots))
    try:
        plan = plan_local(contents)
        if global_rank() == 0 and contents.ranged is None:  # rank 0 holds the data: a meta tensor is the file's own
            check_has_data(plan)
        late = {incoming.slot(t) for t in plan.late_tensors()} - {None}
        needed_first = sorted(everything - late)
    except Exception as err:
        gather_agreed(err, what=NOTHING)
        raise
    early = sorted(set().union(*gather_agreed(None, needed_first, what=NOTHING)))
    arrived, failure = incoming.send(early, what="the broadcast checkpoint's small states")
    error = None
    if failure is not None:
        error = CheckpointError(
            f"{source.path}: receiving the broadcast checkpoint's small states failed ({type(failure).__name__}: "
            f"{failure}) before anything changed, so nothing was restored on any rank; resume again"
        )
    agree_across_ranks(error, what=NOTHING, fallback=CheckpointError)
    if error is not None:
        raise error from failure
    plan = plan.rebind({id(incoming.tensor(i)): t for i, t in arrived.items()})
    return plan, plan.apply(agree=agree, transfer=transfer_late(incoming, sorted(everything - set(early))))
