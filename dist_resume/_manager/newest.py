"""The folder's checkpoint a resume takes, and how much of it each rank touches to choose it.

Rank 0 chooses the newest complete checkpoint (:func:`~dist_resume._source.consensus.choose_newest`: the zip
directory, the small records and their CRC-32s, the metadata, and the CRC-32 of every tensor record, which reads the
whole file). A resume that reads a local torch file striped (every rank its share of the tensor records, the shares
exchanged: :mod:`~dist_resume._checkpoint.striped`) would then have rank 0 touch the whole file on top of its share
(issue 44: at 2 ranks, a 428 MB file, rank 0 mapped 334 MB of it beside its 207 MB share). So for such a resume rank 0
checks every candidate's structure alone (the same check but the tensor records' CRC-32s); those are checked by every
rank on its own share when ``ResumeOptions(verify=True)`` asks, before anything changes, and a damaged one makes the
resume take the checkpoint before it (:mod:`~dist_resume._checkpoint.fallback`), as the choice would have. Without
``verify`` a striped resume of the manager's folder, like ``resume(path)``, reads the tensor records as they are.
"""

from __future__ import annotations

from pathlib import Path

from .._checkpoint.options import ResumeOptions
from .._checkpoint.striped import stripes
from .._core.location import Location
from .._core.log import logger
from .._layout.layout import Layout
from .._source.consensus import choose_newest
from .._source.integrity import CheckpointInfo
from .._source.listing import first_valid
from .._source.source import Source

__all__ = ["reads_striped", "choose_for_resume"]


def reads_striped(folder: Location, options: ResumeOptions, *, broadcast: bool) -> bool:
    """Whether a resume of ``folder``'s torch files reads them striped (:func:`~dist_resume._checkpoint.striped.stripes`
    of such a file). Local; the same on every rank."""
    return isinstance(folder, Path) and stripes(Source.newest(folder, folder, "", broadcast=broadcast), options)


def choose_for_resume(
    folder: Location, listed: list[tuple[int, Location]], *, striped: bool, skipped: frozenset[Location] = frozenset()
) -> CheckpointInfo:
    """Rank 0: the newest complete checkpoint of ``listed`` (the folder's, by name) but ``skipped`` (damaged, found by
    the ranks); with ``striped`` its tensor records' CRC-32s are not read (see the module). Local; raises what
    :func:`~dist_resume._source.consensus.choose_newest` raises when there is none."""
    remaining = [(step, path) for step, path in listed if path not in skipped]
    if striped:
        info, bad = first_valid(reversed(remaining), verify=False)
        for path, err in bad:
            logger.warning("skipping checkpoint %s: %s", path, err)
        if info is not None and info.layout != Layout.SHARDED.value:  # a sharded folder is not read striped
            return info
    return choose_newest(folder, remaining)
