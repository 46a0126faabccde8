"""``dist-resume inspect``: what a checkpoint holds, one report for every kind of source, and its words.

One concept per module: ``_report``: the report of a torch file or a foreign source (:func:`describe_checkpoint`);
``_sources``: how a foreign source is read (its files, its parts, what it leaves unread; :func:`check_sharded`, which
``verify`` uses too); ``_optim``: what the report says about a saved optimizer; ``_render``: the report in words
(:func:`render_inspect`).
"""

from __future__ import annotations

from ._render import render_inspect
from ._report import describe_checkpoint
from ._sources import check_sharded

__all__ = ["describe_checkpoint", "render_inspect", "check_sharded"]
