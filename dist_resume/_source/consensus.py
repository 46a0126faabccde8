"""Agreement between ranks on the checkpoint to resume from: rank 0 chooses, every rank confirms.

:func:`resolve_source` is where a resume decides what it reads, once: a torch file, a foreign source, or a
``CheckpointManager`` folder's newest complete checkpoint (rank 0 chooses, every rank confirms it sees that file).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Final

import torch.distributed as dist

from .._core.errors import (
    CheckpointConsensusError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
)
from .._core.location import Location
from .._core.text import preview
from .._core.types import PathLike
from .._dist.comm import all_gather_objects, collective_step, run_on_rank0
from .._dist.env import is_distributed
from .._foreign.folders import checkpoint_subfolders, foreign_kind, unrecognised_folder
from .._layout.layout import Layout
from .._store.url import location
from .integrity import CheckpointInfo, checkpoint_identity
from .listing import find_latest
from .source import Source

__all__ = ["ViewStatus", "RankView", "choose_newest", "confirm_choice", "resolve_source", "resolve_checkpoint"]


def choose_newest(folder: Location, numbered: list[tuple[int, Location]] | None = None) -> CheckpointInfo:
    """Rank 0's choice: the newest complete checkpoint, or an error that says why there is none. Local.

    ``numbered``: the folder's listing, when the caller has it already (the folder is listed once)."""
    info, skipped = find_latest(folder, verify=True, numbered=numbered)
    if info is not None:
        return info
    if skipped:
        reasons = preview((f"{p.name}: {type(e).__name__}" for p, e in skipped), sep="; ", quote=False)
        raise CheckpointCorruptError(
            f"checkpoint folder {str(folder)!r} holds {len(skipped)} checkpoint(s) and none is complete and "
            f"intact ({reasons}; first: {skipped[0][1]}); restore a good checkpoint into it, or pass a "
            "checkpoint file to resume() explicitly"
        )
    if checkpoint_subfolders(folder):  # the parent of checkpoints (an HF output_dir): a wrong path, not a first run
        raise unrecognised_folder(folder)
    others = sorted(p.name for p in folder.iterdir())
    found = f"; it holds {preview(others, quote=False)}" if others else " (it is empty)"
    raise CheckpointNotFoundError(
        f"checkpoint folder {str(folder)!r} holds no checkpoint named ckpt_<step>.pt or ckpt_<step>.dcp{found}; start from "
        "scratch (catch CheckpointNotFoundError), or pass a checkpoint file to resume()"
    )


class ViewStatus(Enum):
    """What one rank finds at the path rank 0 chose."""

    OK = "ok"
    MISSING = "missing"
    UNREADABLE = "unreadable"


@dataclass(frozen=True)
class RankView:
    """One rank's view of the chosen checkpoint, sent to every rank."""

    status: ViewStatus
    path: str
    size: int = -1
    digest: str = ""
    reason: str = ""  # why it is unreadable

    def matches(self, chosen: CheckpointInfo) -> bool:
        return self.status is ViewStatus.OK and (self.size, self.digest) == (chosen.size, chosen.digest)

    def describe(self, rank: int) -> str:
        if self.status is ViewStatus.MISSING:
            return f"rank {rank} has no file {self.path!r}"
        if self.status is ViewStatus.UNREADABLE:
            return f"rank {rank} cannot read {self.path!r} ({self.reason})"
        return f"rank {rank} sees {self.path!r} with {self.size} bytes, digest {self.digest[:12]}"


def _view(path: Location) -> RankView:
    """What this rank sees at ``path`` (a file, or a sharded checkpoint folder)."""
    try:
        if not path.exists():
            return RankView(ViewStatus.MISSING, str(path))
        return RankView(ViewStatus.OK, str(path), *checkpoint_identity(path))
    except (CheckpointNotFoundError, FileNotFoundError):
        return RankView(ViewStatus.MISSING, str(path))
    except (CheckpointError, OSError) as err:
        return RankView(ViewStatus.UNREADABLE, str(path), reason=f"{type(err).__name__}: {err}")


_AGREE_HINT = (
    "a rank died, is stuck, or did not call resume() with a checkpoint folder; check every rank's log for "
    "the first error, then restart the job (the checkpoints in the folder are untouched)"
)


def _agree(folder: Location) -> tuple[CheckpointInfo, Location]:
    chosen: CheckpointInfo = run_on_rank0(
        lambda: choose_newest(folder),
        fallback=CheckpointConsensusError,
        task=f"choose the checkpoint in {str(folder)!r}",
        hint=_AGREE_HINT,
    )
    return chosen, confirm_choice(folder, chosen)


def confirm_choice(folder: Location, chosen: CheckpointInfo) -> Location:
    """Every rank checks that it sees ``chosen`` (rank 0's choice) in its own ``folder``; this rank's path to it.

    Collective under torch.distributed (one object all-gather); a rank that sees another file, or none,
    makes every rank raise :class:`CheckpointConsensusError` naming the ranks that differ. Local (returns
    ``chosen.path``) in a single process.
    """
    if not is_distributed():
        return chosen.path
    mine = folder / chosen.path.name
    view = RankView(ViewStatus.OK, str(mine), chosen.size, chosen.digest) if dist.get_rank() == 0 else _view(mine)
    step = f"agreeing on the checkpoint rank 0 chose in {str(folder)!r} ({chosen.path.name})"
    with collective_step(step, CheckpointConsensusError, _AGREE_HINT):
        views: list[RankView] = all_gather_objects(view)
    differ = [r for r, v in enumerate(views) if not v.matches(chosen)]
    if differ:  # every rank holds every view: each one raises, with the same ranks
        shown = preview((views[r].describe(r) for r in differ), 8, sep="; ", quote=False)
        raise CheckpointConsensusError(
            f"ranks {differ} do not see the checkpoint rank 0 chose, {chosen.path.name} (step {chosen.step}, "
            f"{chosen.size} bytes, digest {chosen.digest[:12]}): {shown}. Every rank must resume from the same "
            "file: use a folder on a shared filesystem, or copy the checkpoint to every node (and let the copy "
            "finish) before resuming",
            ranks=differ,
        )
    return mine


_FILE: Final = "a checkpoint file"
_KIND_HINT: Final = (
    "a rank died, is stuck, or did not call resume() (every rank calls it, each with the same kind of source); check "
    "every rank's log for the first error, then restart the job (the checkpoints are untouched)"
)


_BROADCAST: Final = "a checkpoint rank 0 broadcasts (broadcast_from_rank0=True)"
_FOLDER: Final = "a checkpoint folder"


def _same_kind(path: Location, kind: str) -> None:
    """Every rank resumes from the same kind of source (a file, a ``CheckpointManager`` folder, or rank 0's
    broadcast): the collectives that follow differ by kind, so ranks that disagree would wait on each other.
    Collective (one object all-gather); ranks that differ from rank 0 make every rank raise
    :class:`CheckpointConsensusError` naming them. Files are not compared: each rank restores the file it names."""
    step = f"agreeing on what every rank resumes from (this rank: {str(path)!r})"
    other = CheckpointConsensusError(
        "the ranks made different calls: this rank resumes while another is in another collective (a save, a "
        f"barrier), so nothing was restored; {_KIND_HINT}"
    )
    try:
        with collective_step(step, CheckpointConsensusError, _KIND_HINT):
            views: list[Any] = all_gather_objects((kind, str(path)))
    except CheckpointConsensusError:
        raise
    except Exception as err:  # what another collective sent does not decode as a view
        raise other from err
    if not all(isinstance(v, tuple) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in views):
        raise other
    differ = [r for r, (kind, _) in enumerate(views) if kind != views[0][0]]
    if differ:
        shown = preview((f"rank {r}: {views[r][0]} {views[r][1]!r}" for r in [0, *differ]), 8, sep="; ", quote=False)
        raise CheckpointConsensusError(
            f"the ranks resume from different kinds of source ({shown}), so nothing was restored on any rank. Every "
            "rank must pass the same kind: the same checkpoint folder, a checkpoint file each, and the same "
            "broadcast_from_rank0",
            ranks=differ,
        )


def _looked_up(path: Location) -> tuple[Layout | None, bool]:
    """``path``'s foreign layout (a .safetensors file, an HF Trainer / Accelerate / DCP folder) or None, and
    whether it is a ``CheckpointManager`` folder: asked once per resume."""
    layout = foreign_kind(path)
    return layout, layout is None and path.is_dir()


def _decide(
    path: Location, *, agree: bool, broadcast: bool, looked: tuple[Layout | None, bool] | None = None
) -> Source:
    """The source at ``path`` (``looked``: :func:`_looked_up` of it, when known); for a ``CheckpointManager`` folder
    its newest complete checkpoint, agreed on by every rank when ``agree`` (collective), else chosen by this rank."""
    layout, folder = _looked_up(path) if looked is None else looked
    if not folder:
        return Source.at(path, layout, broadcast=broadcast)
    if agree:
        chosen, mine = _agree(path)
    else:
        chosen = choose_newest(path)
        mine = chosen.path
    return Source.newest(mine, path, chosen.layout, broadcast=broadcast)


def resolve_source(path: Location, *, broadcast: bool = False) -> Source:
    """What a resume of ``path`` reads: decided once, then passed down. Collective under torch.distributed (every
    rank passes the same kind of source; for a folder, the same checkpoint), local otherwise.

    A file (torch or ``.safetensors``) and a foreign folder are what they are (each rank looks at its own
    path). Any other folder is taken for a ``CheckpointManager`` folder: rank 0 chooses its newest complete
    checkpoint and every rank confirms it sees that file (see :func:`resolve_checkpoint`). With ``broadcast``
    (under torch.distributed) only global rank 0 looks at the filesystem, and every rank receives its
    decision: the others need not see the path at all.
    """
    p = path
    if broadcast and is_distributed():
        _same_kind(p, _BROADCAST)  # only rank 0 looks at the path
        decided: Source = run_on_rank0(
            lambda: _decide(p, agree=False, broadcast=True),
            fallback=CheckpointError,
            task=f"choose the checkpoint to read at {str(p)!r}",
        )
        return decided
    looked = _looked_up(p)
    if is_distributed():
        _same_kind(p, _FOLDER if looked[1] else _FILE)
    return _decide(p, agree=is_distributed(), broadcast=False, looked=looked)


def resolve_checkpoint(path: PathLike) -> Location:
    """The file (or foreign folder) to resume from: ``path`` itself, or for a checkpoint folder the newest
    complete checkpoint in it.

    For a file or a foreign folder (HF Trainer, Accelerate, DCP): local, returns it unchanged
    (:func:`~dist_resume.load_checkpoint` reports what is wrong with it). For a ``CheckpointManager`` folder:
    collective under torch.distributed (call it on every rank, each with its own view of the folder): rank 0
    chooses (:func:`latest_checkpoint` with ``verify=True``) and broadcasts the choice; every rank checks it sees
    that file with the same size and digest (a local copy in its own folder is fine). A rank that sees
    something else makes every rank raise :class:`~dist_resume.errors.CheckpointConsensusError` naming the ranks
    that differ; a dead or absent rank ends in the same error within the process-group timeout. An empty folder
    raises :class:`~dist_resume.errors.CheckpointNotFoundError`; a folder whose checkpoints are all damaged raises
    :class:`~dist_resume.errors.CheckpointCorruptError` (never silently "start from scratch").

    Example::

        >>> path = dist_resume.CheckpointManager("ckpts", model=torch.nn.Linear(2, 2)).save(5)
        >>> dist_resume.tools.resolve_checkpoint("ckpts")
        PosixPath('ckpts/ckpt_00000005.pt')
    """
    return resolve_source(location(path)).path  # the entry: decided here, passed down as it is
